/* The C side of tools/llamacpp.py: a prompt's last logits from llama.cpp, with or without
   a LoRA adapter, through plain arguments (no by-value parameter structs in ctypes). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"

static char last_error[512];

static void on_log(enum ggml_log_level level, const char * text, void * data) {
    (void)data;
    if (level == GGML_LOG_LEVEL_ERROR) snprintf(last_error, sizeof last_error, "%s", text);
}

const char * pe_llama_error(void) { return last_error; }

/* The logits of the last of n_tokens tokens, into out[n_out]; the vocabulary size, or -1
   (pe_llama_error says why). lora_path NULL: the base model alone. */
int pe_llama_last_logits(const char * model_path, const char * lora_path, float scale,
                         const int32_t * tokens, int32_t n_tokens, int32_t n_threads,
                         float * out, int32_t n_out) {
    int result = -1;
    last_error[0] = 0;
    llama_log_set(on_log, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        if (!last_error[0]) snprintf(last_error, sizeof last_error, "cannot load %s", model_path);
        return -1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)(n_tokens < 64 ? 64 : n_tokens);
    cp.n_batch = cp.n_ubatch = cp.n_ctx;
    cp.n_threads = cp.n_threads_batch = n_threads;
    cp.no_perf = 1;
    cp.type_k = cp.type_v = GGML_TYPE_F32; /* no f16 rounding in the KV cache */
    struct llama_context * ctx = llama_init_from_model(model, cp);
    struct llama_adapter_lora * adapter = NULL;
    llama_token * ids = NULL;
    if (!ctx) { snprintf(last_error, sizeof last_error, "cannot make a context"); goto done; }
    if (lora_path) {
        adapter = llama_adapter_lora_init(model, lora_path);
        if (!adapter) goto done;
        if (llama_set_adapter_lora(ctx, adapter, scale) != 0) {
            snprintf(last_error, sizeof last_error, "llama_set_adapter_lora failed");
            goto done;
        }
    }
    ids = (llama_token *)malloc(sizeof(llama_token) * (size_t)n_tokens);
    memcpy(ids, tokens, sizeof(llama_token) * (size_t)n_tokens);
    if (llama_decode(ctx, llama_batch_get_one(ids, n_tokens)) != 0) {
        snprintf(last_error, sizeof last_error, "llama_decode failed");
        goto done;
    }
    int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const float * logits = llama_get_logits_ith(ctx, -1);
    if (!logits) { snprintf(last_error, sizeof last_error, "no logits"); goto done; }
    memcpy(out, logits, sizeof(float) * (size_t)(n_vocab < n_out ? n_vocab : n_out));
    result = n_vocab;
done:
    free(ids);
    if (adapter) llama_adapter_lora_free(adapter);
    if (ctx) llama_free(ctx);
    llama_model_free(model);
    return result;
}
