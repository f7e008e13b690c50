"""Tiny random Hugging Face models (configs built in code, nothing downloaded) as Workloads.

Each builder returns a ``Workload`` whose loss is the model's own (``labels=`` passed
through), so the whole head, loss included, goes through the frontend. Every dropout
probability in the config is set to 0 so that PockEngine's gradients and torch.autograd's
see the same function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pockengine.zoo import Workload

__all__ = ["ARCHITECTURES", "Arch"]

_VOCAB, _HIDDEN, _SEQ, _BATCH, _CLASSES = 100, 32, 8, 2, 3
_TEXT = {
    "hidden_size": _HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "vocab_size": _VOCAB,
}


@dataclass(frozen=True)
class Arch:
    """One architecture: its family, a builder, and whether the default test run has it."""

    name: str
    family: str
    build: Callable[[], Workload]
    fast: bool = False
    # float64: a random-init network whose float32 gradients torch itself cannot reproduce
    # to 1e-4 (ReLU6 kinks flip with rounding; see tests/test_models.py)
    double: bool = False


def _no_dropout(cfg: Any) -> Any:
    """Every float config field about dropout (``*dropout*``, ``*_pdrop``, ``drop_path*``) to 0."""
    for key, value in list(vars(cfg).items()):
        dropish = "dropout" in key or key.endswith("_pdrop") or "drop_path" in key
        if dropish and isinstance(value, float):
            setattr(cfg, key, 0.0)
    return cfg


def _model(auto: str, config_cls: str, **kw: Any) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = _no_dropout(getattr(transformers, config_cls)(**kw))
    model: nn.Module = getattr(transformers, auto).from_config(cfg)
    return model


def _token_batch(classes: int | None) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, _VOCAB, (_BATCH, _SEQ), generator=g)
        mask = torch.ones(_BATCH, _SEQ, dtype=torch.long)
        mask[1, _SEQ - 2 :] = 0  # one padded sequence exercises the attention mask
        if classes is None:
            return ids, mask
        return ids, mask, torch.randint(0, classes, (_BATCH,), generator=g)

    return make


def _classify_loss(model: nn.Module, ids: Any, mask: Any, y: Any) -> torch.Tensor:
    # cross-entropy on the logits: DeBERTa's own loss picks labelled rows with nonzero()
    logits = model(input_ids=ids, attention_mask=mask).logits
    return F.cross_entropy(logits, y)


def _multilabel_batch(seed: int) -> tuple[torch.Tensor, ...]:
    ids, mask = _token_batch(None)(seed)
    g = torch.Generator().manual_seed(seed + 1)
    return ids, mask, (torch.rand(_BATCH, _CLASSES, generator=g) > 0.5).float()


def _multilabel_loss(model: nn.Module, ids: Any, mask: Any, y: Any) -> torch.Tensor:
    # the model's own loss: binary cross-entropy with logits (log1p in its decomposition)
    return model(input_ids=ids, attention_mask=mask, labels=y).loss  # type: ignore[no-any-return]


def _lm_loss(model: nn.Module, ids: Any, mask: Any) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
    return out.loss  # type: ignore[no-any-return]


def _seq2seq_loss(model: nn.Module, ids: Any, mask: Any) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
    return out.loss  # type: ignore[no-any-return]


def _image_loss(model: nn.Module, x: Any, y: Any) -> torch.Tensor:
    return model(pixel_values=x, labels=y).loss  # type: ignore[no-any-return]


def _encoder(config_cls: str, **kw: Any) -> Callable[[], Workload]:
    def build() -> Workload:
        model = _model(
            "AutoModelForSequenceClassification", config_cls, num_labels=_CLASSES, **{**_TEXT, **kw}
        )
        return Workload(config_cls, model, _classify_loss, _token_batch(_CLASSES))

    return build


def _multilabel(config_cls: str, **kw: Any) -> Callable[[], Workload]:
    def build() -> Workload:
        model = _model(
            "AutoModelForSequenceClassification",
            config_cls,
            num_labels=_CLASSES,
            problem_type="multi_label_classification",
            **{**_TEXT, **kw},
        )
        return Workload(config_cls, model, _multilabel_loss, _multilabel_batch)

    return build


def _decoder(config_cls: str, **kw: Any) -> Callable[[], Workload]:
    def build() -> Workload:
        model = _model("AutoModelForCausalLM", config_cls, **kw)
        return Workload(config_cls, model, _lm_loss, _token_batch(None))

    return build


def _seq2seq(config_cls: str, **kw: Any) -> Callable[[], Workload]:
    def build() -> Workload:
        model = _model("AutoModelForSeq2SeqLM", config_cls, **kw)
        return Workload(config_cls, model, _seq2seq_loss, _token_batch(None))

    return build


def _vision(config_cls: str, size: int = 32, **kw: Any) -> Callable[[], Workload]:
    def build() -> Workload:
        model = _model("AutoModelForImageClassification", config_cls, num_labels=_CLASSES, **kw)

        def make(seed: int) -> tuple[torch.Tensor, ...]:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(_BATCH, 3, size, size, generator=g)
            return x, torch.randint(0, _CLASSES, (_BATCH,), generator=g)

        return Workload(config_cls, model, _image_loss, make)

    return build


def _audio(
    config_cls: str, features: tuple[int, ...], key: str, **kw: Any
) -> Callable[[], Workload]:
    """An audio classifier on random ``features`` per example (log-mel frames or samples)."""

    def build() -> Workload:
        model = _model("AutoModelForAudioClassification", config_cls, num_labels=_CLASSES, **kw)

        def make(seed: int) -> tuple[torch.Tensor, ...]:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(_BATCH, *features, generator=g)
            return x, torch.randint(0, _CLASSES, (_BATCH,), generator=g)

        def loss(model: nn.Module, x: Any, y: Any) -> torch.Tensor:
            return model(**{key: x}, labels=y).loss  # type: ignore[no-any-return]

        return Workload(config_cls, model, loss, make)

    return build


# fmt: off
_LM = {"vocab_size": _VOCAB, "hidden_size": _HIDDEN, "num_hidden_layers": 2,
       "intermediate_size": 64}
_GQA = {**_LM, "num_attention_heads": 4, "num_key_value_heads": 2}
# mixture-of-experts decoders: 4 experts, 2 a token; the experts as one batched matmul over
# the (token, expert) pairs (transformers' default sorts tokens by expert: dynamic shapes)
_MOE = {**_GQA, "num_experts_per_tok": 2, "experts_implementation": "batched_mm"}

ARCHITECTURES: tuple[Arch, ...] = (
    # text encoders
    Arch("bert", "encoder", _encoder("BertConfig"), fast=True),
    Arch("roberta", "encoder", _encoder("RobertaConfig", pad_token_id=1)),
    Arch("distilbert", "encoder", _encoder("DistilBertConfig", dim=_HIDDEN, n_layers=2,
                                           n_heads=4, hidden_dim=64)),
    Arch("albert", "encoder", _encoder("AlbertConfig", embedding_size=16)),
    Arch("electra", "encoder", _encoder("ElectraConfig", embedding_size=16)),
    Arch("deberta-v2", "encoder", _encoder("DebertaV2Config")),
    Arch("roberta-multilabel", "encoder", _multilabel("RobertaConfig", pad_token_id=1)),
    # decoders
    Arch("gpt2", "decoder", _decoder("GPT2Config", vocab_size=_VOCAB, n_embd=_HIDDEN, n_layer=2,
                                     n_head=4, n_positions=64), fast=True),
    Arch("llama", "decoder", _decoder("LlamaConfig", **_GQA), fast=True),
    Arch("mistral", "decoder", _decoder("MistralConfig", **_GQA)),
    Arch("qwen2", "decoder", _decoder("Qwen2Config", **_GQA)),
    Arch("phi", "decoder", _decoder("PhiConfig", **_LM, num_attention_heads=4)),
    Arch("gpt-neox", "decoder", _decoder("GPTNeoXConfig", **_LM, num_attention_heads=4)),
    Arch("opt", "decoder", _decoder("OPTConfig", vocab_size=_VOCAB, hidden_size=_HIDDEN,
                                    num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                                    word_embed_proj_dim=_HIDDEN)),
    Arch("bloom", "decoder", _decoder("BloomConfig", vocab_size=_VOCAB, hidden_size=_HIDDEN,
                                      n_layer=2, n_head=4)),
    Arch("falcon", "decoder", _decoder("FalconConfig", vocab_size=_VOCAB, hidden_size=_HIDDEN,
                                       num_hidden_layers=2, num_attention_heads=4)),
    Arch("gemma", "decoder", _decoder("GemmaConfig", **_GQA, head_dim=8)),
    Arch("gpt-j", "decoder", _decoder("GPTJConfig", vocab_size=_VOCAB, n_embd=_HIDDEN, n_layer=2,
                                      n_head=4, rotary_dim=4, n_positions=64)),
    Arch("gpt-neo", "decoder", _decoder("GPTNeoConfig", vocab_size=_VOCAB, hidden_size=_HIDDEN,
                                        num_layers=2, num_heads=4, window_size=4,
                                        attention_types=[[["global", "local"], 1]],
                                        max_position_embeddings=64)),
    # mixture-of-experts decoders (aten.topk routers)
    Arch("mixtral", "decoder", _decoder("MixtralConfig", **_MOE, num_local_experts=4)),
    Arch("qwen2-moe", "decoder", _decoder("Qwen2MoeConfig", **_MOE, num_experts=4,
                                          moe_intermediate_size=32,
                                          shared_expert_intermediate_size=32)),
    Arch("qwen3-moe", "decoder", _decoder("Qwen3MoeConfig", **_MOE, num_experts=4,
                                          moe_intermediate_size=32, head_dim=8)),
    Arch("olmoe", "decoder", _decoder("OlmoeConfig", **_MOE, num_experts=4)),
    Arch("granitemoe", "decoder", _decoder("GraniteMoeConfig", **_MOE, num_local_experts=4)),
    # encoder-decoders
    Arch("t5", "encoder-decoder", _seq2seq("T5Config", vocab_size=_VOCAB, d_model=_HIDDEN,
                                           d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                           decoder_start_token_id=0)),
    Arch("bart", "encoder-decoder", _seq2seq("BartConfig", vocab_size=_VOCAB, d_model=_HIDDEN,
                                             encoder_layers=2, decoder_layers=2,
                                             encoder_attention_heads=4, decoder_attention_heads=4,
                                             encoder_ffn_dim=64, decoder_ffn_dim=64)),
    # vision
    Arch("resnet", "vision", _vision("ResNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                                     depths=[1, 1], layer_type="basic"), fast=True),
    Arch("convnext", "vision", _vision("ConvNextConfig", hidden_sizes=[8, 16], depths=[1, 1],
                                       num_stages=2)),
    Arch("mobilenet-v2", "vision", _vision("MobileNetV2Config", depth_multiplier=0.35),
         double=True),
    Arch("efficientnet", "vision", _vision("EfficientNetConfig", width_coefficient=0.25,
                                           depth_coefficient=0.25, image_size=32,
                                           hidden_dim=320)),
    Arch("regnet", "vision", _vision("RegNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                                     depths=[1, 1], groups_width=8)),
    Arch("mobilevit", "vision", _vision("MobileViTConfig", image_size=32,
                                        hidden_sizes=[16, 24, 32],
                                        neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32])),
    Arch("mobilenet-v1", "vision", _vision("MobileNetV1Config", depth_multiplier=0.25,
                                           min_depth=4), double=True),
    Arch("bit", "vision", _vision("BitConfig", embedding_size=8, hidden_sizes=[8, 16],
                                  depths=[1, 1], num_groups=4, layer_type="preactivation")),
    Arch("poolformer", "vision", _vision("PoolFormerConfig", num_encoder_blocks=2,
                                         depths=[1, 1], hidden_sizes=[8, 16],
                                         patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1],
                                         num_attention_heads=[1, 1], mlp_ratio=2.0)),
    Arch("segformer", "vision", _vision("SegformerConfig", num_encoder_blocks=2, depths=[1, 1],
                                        hidden_sizes=[8, 16], sr_ratios=[2, 1],
                                        num_attention_heads=[1, 2], decoder_hidden_size=16)),
    Arch("convnextv2", "vision", _vision("ConvNextV2Config", hidden_sizes=[8, 16],
                                         depths=[1, 1], num_stages=2)),
    Arch("focalnet", "vision", _vision("FocalNetConfig", embed_dim=8, depths=[1, 1],
                                       hidden_sizes=[8, 16])),
    Arch("dinov2", "vision", _vision("Dinov2Config", image_size=32, patch_size=8, **_TEXT)),
    Arch("beit", "vision", _vision("BeitConfig", image_size=32, patch_size=8, **_TEXT)),
    Arch("vit", "vision", _vision("ViTConfig", image_size=32, patch_size=8, **_TEXT), fast=True),
    Arch("mobilevitv2", "vision", _vision("MobileViTV2Config", size=64, image_size=64,
                                          width_multiplier=0.25), double=True),
    Arch("swin", "vision", _vision("SwinConfig", image_size=32, patch_size=4, embed_dim=8,
                                   depths=[1, 1], num_heads=[2, 2], window_size=4)),
    # audio: Whisper's encoder looks its learned positions up with arange
    Arch("whisper", "audio", _audio("WhisperConfig", (8, 16), "input_features", num_mel_bins=8,
                                    max_source_positions=8, d_model=_HIDDEN, encoder_layers=1,
                                    encoder_attention_heads=4, encoder_ffn_dim=64,
                                    decoder_layers=1, decoder_attention_heads=4,
                                    decoder_ffn_dim=64, vocab_size=_VOCAB)),
    Arch("ast", "audio", _audio("ASTConfig", (16, 8), "input_values", num_mel_bins=8,
                                max_length=16, patch_size=4, frequency_stride=4, time_stride=4,
                                **_TEXT)),
)
# fmt: on
