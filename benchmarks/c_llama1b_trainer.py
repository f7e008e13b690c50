"""A LLaMA-3.2-1B-shaped model in 4-bit GGUF, LoRA r8 on q/v, 1 x 256 tokens: the
stand-alone C trainer's whole-process peak and speed, beside the torch backend's.

No package ships LLaMA-3.2-1B's weights, so the model has its shape (16 layers, hidden
2048, 32 heads / 8 kv heads, intermediate 8192, vocabulary 128256, tied embeddings, RoPE
theta 500000) and RANDOM weights (normal, std 0.02; norms 1): the figures are memory and
speed, not quality. The weights are written as a Q4_0 GGUF with the ``gguf`` package into
a temporary folder, generated and quantized a few rows at a time (the writer never holds
the 5 GB of float32 they would take), and read back with ``tasks.gguf.llama_weights``.

Case ``c``: the model built on the ``meta`` device with stand-ins for the GGUF-block
weights (``released.stand_in``: no float copy of them), compiled on the C backend with
``memory_budget`` (recomputation), exported with ``step.export(folder, target="c")``,
built with ``make NATIVE=1 STATIC=1 SMALL=1`` and run as ``./train --memory-report`` for
``--steps`` steps on one thread: whole-process peak and its split (file pages: the mapped
frozen tensors and the code; anonymous: arena, state, libc), tokens per second (median
of the steps after the first, wall clock and process CPU time as ./train reports them),
the losses, and how long each export phase took. Case ``torch``: the same model and blocks
compiled on the torch backend (one thread), the same batches: the median step time after
the first (wall clock and process CPU time) and the whole-process peak. Each case runs in
its own process.

    PYTHONPATH=$PWD python benchmarks/c_llama1b_trainer.py --steps 3 [--budget 200MB] \
        [--cases c torch] [--out benchmarks/results/c_llama1b_trainer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _harness import trainer_step_seconds

SHAPE = {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192,
         "vocab": 128256, "rope_theta": 500000.0}  # fmt: skip
SEQ = 256
TOKENS = SEQ
_CHUNK = 1 << 22  # float32 values generated and quantized at once (16 MiB)


def _config(shape: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], intermediate_size=shape["ffn"],
        max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
    )  # fmt: skip


def _tensors(shape: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The GGUF tensors of the model, in file order: (name, numpy shape)."""
    h, f, kv = shape["hidden"], shape["ffn"], shape["hidden"] // shape["heads"] * shape["kv_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape["vocab"], h))]
    for i in range(shape["layers"]):
        out += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (h, h)),
                (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                (f"blk.{i}.attn_output.weight", (h, h)), (f"blk.{i}.ffn_norm.weight", (h,)),
                (f"blk.{i}.ffn_gate.weight", (f, h)), (f"blk.{i}.ffn_up.weight", (f, h)),
                (f"blk.{i}.ffn_down.weight", (h, f))]  # fmt: skip
    return [*out, ("output_norm.weight", (h,))]


def _q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray[Any, Any]:
    """A random [rows, cols] matrix (std 0.02) as Q4_0 blocks, a few rows at a time."""
    from gguf import GGMLQuantizationType, quants

    step = max(1, _CHUNK // cols)
    parts = []
    for lo in range(0, rows, step):
        w = rng.standard_normal((min(step, rows - lo), cols), dtype=np.float32) * 0.02
        parts.append(quants.quantize(w, GGMLQuantizationType.Q4_0))
    return np.concatenate(parts)


def write_gguf(path: Path, shape: dict[str, Any], seed: int = 0) -> Path:
    """The model as a Q4_0 GGUF (float32 norms), tensor by tensor (``gguf`` streaming
    writer: the tensor infos first, then each tensor's bytes as it is made)."""
    import gguf

    q4 = gguf.GGMLQuantizationType.Q4_0
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("random LLaMA-3.2-1B-shaped (random weights)")
    writer.add_context_length(2048)
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_vocab_size(shape["vocab"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    tensors = _tensors(shape)
    for name, dims in tensors:
        if len(dims) == 1:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            nbytes = dims[0] * dims[1] // 32 * 18
            writer.add_tensor_info(name, (dims[0], dims[1] // 32 * 18), np.dtype(np.uint8),
                                   nbytes, raw_dtype=q4)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims in tensors:
        data = np.ones(dims, np.float32) if len(dims) == 1 else _q4_0(rng, *dims)
        writer.write_tensor_data(data)
    writer.close()
    return path


def build_model(shape: dict[str, Any], blocks: dict[str, Any]) -> Any:
    """The model with stand-ins (one zero, broadcast, as ``released.stand_in`` makes) for
    the weights in ``blocks``: only the norms and the rotary tables hold memory."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _config(shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    for name, p in list(model.named_parameters()):
        module, _, local = name.rpartition(".")
        value = torch.zeros(()).expand(p.shape) if name in blocks else torch.ones(p.shape)
        setattr(model.get_submodule(module), local, torch.nn.Parameter(value, requires_grad=False))
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)
    return model


def _batches(steps: int, vocab: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(1).integers(0, vocab, (steps, 1, SEQ), dtype=np.int64)


def _compile(backend: str, shape: dict[str, Any], gguf_path: Path, budget: str | None) -> Any:
    import torch

    import pockengine as pe
    from pockengine import zoo
    from pockengine.tasks.gguf import llama_weights

    blocks = llama_weights(gguf_path)
    model = build_model(shape, blocks)
    lora = pe.schemes.lora(rank=8, alpha=16, targets=["*q_proj", "*v_proj"])
    batch = (torch.zeros((1, SEQ), dtype=torch.int64),)
    return pe.compile(model, zoo._causal_lm, batch, scheme=lora, backend=backend,
                      optimizer=pe.optim.AdamW(lr=1e-4), quantized=blocks,
                      memory_budget=budget, compile_in="process")  # fmt: skip


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(key + ":"))


def _c_case(args: argparse.Namespace, work: Path, gguf_path: Path) -> dict[str, Any]:
    shape = json.loads(args.shape)
    times = {}
    start = time.perf_counter()
    step = _compile("c", shape, gguf_path, args.budget)
    times["compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    folder = step.export(work / "trainer", target="c")
    times["export_s"] = time.perf_counter() - start
    export_peak = _status_kb("VmHWM") / 1024
    del step
    np.save(folder / "ids.npy", _batches(args.steps, shape["vocab"]))
    start = time.perf_counter()
    subprocess.run(["make", "-s", "-C", str(folder), "NATIVE=1", "STATIC=1", "SMALL=1"],
                   check=True, capture_output=True)  # fmt: skip
    times["make_s"] = time.perf_counter() - start
    run = subprocess.run(["/usr/bin/time", "-v", "./train", "--memory-report", "--steps",
                          str(args.steps), "ids.npy"], cwd=folder, capture_output=True,
                         text=True, check=True)  # fmt: skip
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)
    report = re.search(r"memory MiB: (.*)", run.stderr)
    split = dict(re.findall(r"(\w+) ([\d.]+)", report[1])) if report else {}
    step_s, cpu_step_s = trainer_step_seconds(run.stderr)
    plan = re.search(r"planned peak [^*]*", (folder / "step.c").read_text()[:2000])
    return {
        "case": "c", "budget": args.budget, "peak_mib": int(peak[1]) / 1024 if peak else None,
        "split_mib": {k: float(v) for k, v in split.items()},
        "frozen_file_mib": (folder / "frozen.bin").stat().st_size / 2**20,
        "state_file_mib": (folder / "state.safetensors").stat().st_size / 2**20,
        "code_kib": (folder / "train").stat().st_size / 1024,
        "step_s": step_s, "tokens_per_s": TOKENS / step_s,
        "cpu_step_s": cpu_step_s, "cpu_tokens_per_s": TOKENS / cpu_step_s,
        "plan": plan[0].strip() if plan else None, "export_process_peak_mib": export_peak,
        **times,
        "losses": [float(ln.split()[-1]) for ln in run.stdout.splitlines()
                   if ln.startswith("step ")],
    }  # fmt: skip


def _torch_case(args: argparse.Namespace, gguf_path: Path) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    shape = json.loads(args.shape)
    step = _compile("torch", shape, gguf_path, args.budget)
    losses, times, cpu = [], [], []
    for ids in _batches(args.steps, shape["vocab"]):
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(float(step(ids)))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    step_s = float(np.median(times[1:] or times))
    cpu_step_s = float(np.median(cpu[1:] or cpu))
    return {"case": "torch", "budget": args.budget, "peak_mib": _status_kb("VmHWM") / 1024,
            "step_s": step_s, "tokens_per_s": TOKENS / step_s, "cpu_step_s": cpu_step_s,
            "cpu_tokens_per_s": TOKENS / cpu_step_s, "losses": losses}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", default="200MB", help="memory_budget of the step's plan")
    ap.add_argument("--cases", nargs="+", default=["c", "torch"])
    ap.add_argument("--shape", default=json.dumps(SHAPE), help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.case:
        with tempfile.TemporaryDirectory() as tmp:
            result = (_c_case(args, Path(tmp), Path(args.gguf)) if args.case == "c"
                      else _torch_case(args, Path(args.gguf)))  # fmt: skip
        print(json.dumps(result), flush=True)
        return
    results: list[dict[str, Any]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        gguf_path = write_gguf(Path(tmp) / "llama1b-random-q4_0.gguf", json.loads(args.shape))
        made = {"gguf_mib": gguf_path.stat().st_size / 2**20,
                "gguf_write_s": time.perf_counter() - start}  # fmt: skip
        print(json.dumps({"weights": "RANDOM (LLaMA-3.2-1B shape)", **made}), flush=True)
        for case in args.cases:
            cmd = [
                sys.executable,
                __file__,
                "--case",
                case,
                "--gguf",
                str(gguf_path),
                "--steps",
                str(args.steps),
                "--budget",
                args.budget,
                "--shape",
                args.shape,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)  # fmt: skip
            if out.returncode != 0:
                results.append({"case": case, "failed": out.stderr[-2000:]})
            else:
                results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        record = {"weights": "RANDOM weights of the LLaMA-3.2-1B shape",
                  "shape": json.loads(args.shape), "batch": [1, SEQ],
                  "scheme": "LoRA r8 on q/v, AdamW", **made, "cases": results}  # fmt: skip
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
