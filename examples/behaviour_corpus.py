"""A corpus of estimates that pins torchroof's behaviour: every regime, parallel strategy,
quantisation recipe, timing mode, compare and sweep, each written as JSON and as text.

    python examples/behaviour_corpus.py write DIR     # one .json and one .txt per case
    python examples/behaviour_corpus.py check DIR     # rerun every case, diff against DIR
    python examples/behaviour_corpus.py digest        # rerun, compare with the checked-in digests

A restructuring that changes no behaviour leaves every file byte-identical: ``write`` before
the change, ``check`` after it. ``tests/data/behaviour_corpus.json`` holds the SHA-256 of
every case's JSON and text, so ``digest`` (and tests/test_behaviour_corpus.py, which runs
every case, about 40 seconds here) shows the same without the files. Only public names are
used, so the script outlives any move.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DIGESTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "behaviour_corpus.json"


def small_llama() -> Any:
    """A two-layer Llama with grouped-query attention (8 heads, 2 KV heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=4096,
    )


def small_mixtral() -> Any:
    """A two-layer Mixtral: 8 experts, 2 routed per token."""
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=4096,
    )


def small_deepseek() -> Any:
    """A two-layer DeepSeek-V3 with multi-head latent attention and routed experts."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=128,
        q_lora_rank=192,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        vocab_size=32000,
        max_position_embeddings=4096,
    )


def estimate_case(model: Callable[[], Any] | str, regime: str, **knobs: Any) -> Callable[[], Any]:
    def run() -> Any:
        import torchroof

        return torchroof.estimate(model if isinstance(model, str) else model(), regime, **knobs)

    return run


def compare_case(
    model: Callable[[], Any], regime: str, vary: dict[str, list[Any]], **knobs: Any
) -> Callable[[], Any]:
    def run() -> Any:
        import torchroof

        return torchroof.compare(model(), vary, regime=regime, **knobs)

    return run


def sweep_case(
    model: Callable[[], Any], regime: str, over: str, values: list[int], **knobs: Any
) -> Callable[[], Any]:
    def run() -> Any:
        import torchroof

        return torchroof.sweep(model(), over, values, regime=regime, **knobs)

    return run


L, M, D = small_llama, small_mixtral, small_deepseek
CASES: dict[str, Callable[[], Any]] = {
    # every regime, on a shipped config and on a small one
    "gpt2-prefill": estimate_case("gpt2", "prefill", batch=2, seq=512),
    "gpt2-decode": estimate_case("gpt2", "decode", batch=8, context=512),
    "gpt2-train": estimate_case("gpt2", "train", batch=2, seq=256),
    "llama-prefill": estimate_case(L, "prefill", batch=4, seq=1024),
    "llama-prefill-eager": estimate_case(L, "prefill", batch=4, seq=1024, fusion="eager"),
    "llama-decode": estimate_case(L, "decode", batch=16, context=2048),
    "llama-decode-dynamic-cache": estimate_case(
        L, "decode", batch=4, context=1024, cache="dynamic"
    ),
    "llama-train": estimate_case(L, "train", batch=2, seq=512),
    "llama-train-fp32": estimate_case(L, "train", batch=2, seq=256, precision="fp32"),
    "llama-train-checkpointing": estimate_case(L, "train", batch=2, seq=512, checkpointing=True),
    "llama-train-sgd": estimate_case(L, "train", batch=2, seq=256, optimizer="sgd-momentum"),
    "llama-train-adafactor": estimate_case(L, "train", batch=2, seq=256, optimizer="adafactor"),
    "llama-train-muon": estimate_case(L, "train", batch=2, seq=256, optimizer="muon"),
    "llama-train-chunked-loss": estimate_case(L, "train", batch=2, seq=512, loss="chunked"),
    "llama-prefill-math-attention": estimate_case(L, "prefill", batch=2, seq=512, attention="math"),
    "llama-prefill-fp16-a100": estimate_case(
        L, "prefill", batch=2, seq=512, dtype="fp16", hardware="a100-sxm"
    ),
    "llama-prefill-mi300x": estimate_case(L, "prefill", batch=2, seq=512, hardware="mi300x"),
    "llama-decode-b200": estimate_case(L, "decode", batch=32, context=4096, hardware="b200"),
    # timing modes
    "llama-prefill-realistic": estimate_case(L, "prefill", batch=4, seq=1024, mode="realistic"),
    "llama-decode-realistic": estimate_case(L, "decode", batch=16, context=2048, mode="realistic"),
    "llama-train-realistic": estimate_case(L, "train", batch=2, seq=512, mode="realistic"),
    # quantisation recipes and KV-cache dtypes
    "llama-prefill-fp8": estimate_case(L, "prefill", batch=4, seq=1024, quant="fp8"),
    "llama-prefill-fp8-rowwise": estimate_case(
        L, "prefill", batch=4, seq=1024, quant="fp8-rowwise"
    ),
    "llama-decode-int8-weight": estimate_case(
        L, "decode", batch=8, context=2048, quant="int8-weight"
    ),
    "llama-decode-int4-weight": estimate_case(
        L, "decode", batch=8, context=2048, quant="int4-weight"
    ),
    "llama-decode-fp8-weight": estimate_case(
        L, "decode", batch=8, context=2048, quant="fp8-weight"
    ),
    "llama-decode-mxfp4-b200": estimate_case(
        L, "decode", batch=8, context=2048, quant="mxfp4-weight", hardware="b200"
    ),
    "llama-prefill-nvfp4-b200": estimate_case(
        L, "prefill", batch=2, seq=1024, quant="nvfp4", hardware="b200"
    ),
    "llama-decode-kv-fp8": estimate_case(L, "decode", batch=16, context=4096, kv_dtype="fp8"),
    "llama-train-fp8": estimate_case(L, "train", batch=2, seq=512, quant="fp8"),
    # experts and latent attention
    "mixtral-prefill": estimate_case(M, "prefill", batch=2, seq=1024),
    "mixtral-decode": estimate_case(M, "decode", batch=16, context=2048),
    "mixtral-train-ep2-imbalance": estimate_case(
        M, "train", batch=2, seq=512, ep=2, fsdp=2, routing_imbalance=1.5, hardware="dgx-h100"
    ),
    "deepseek-decode-absorbed": estimate_case(D, "decode", batch=8, context=2048, mla="absorbed"),
    "deepseek-decode-expanded": estimate_case(D, "decode", batch=8, context=2048, mla="expanded"),
    "deepseek-prefill": estimate_case(D, "prefill", batch=2, seq=1024),
    # every parallel strategy, priced on a cluster
    "llama-train-tp2": estimate_case(L, "train", batch=2, seq=512, tp=2, hardware="dgx-h100"),
    "llama-train-tp2-sp": estimate_case(
        L, "train", batch=2, seq=512, tp=2, sequence_parallel=True, hardware="dgx-h100"
    ),
    "llama-train-fsdp4": estimate_case(L, "train", batch=2, seq=512, fsdp=4, hardware="dgx-h100"),
    "llama-train-hsdp": estimate_case(
        L, "train", batch=2, seq=512, fsdp=2, dp=2, hardware="dgx-h100"
    ),
    "llama-train-cp2": estimate_case(L, "train", batch=1, seq=2048, cp=2, hardware="dgx-h100"),
    "llama-prefill-tp2": estimate_case(L, "prefill", batch=4, seq=1024, tp=2, hardware="dgx-h100"),
    "llama-decode-tp2": estimate_case(
        L, "decode", batch=16, context=2048, tp=2, hardware="dgx-h100"
    ),
    "mixtral-train-ep2": estimate_case(
        M, "train", batch=2, seq=512, ep=2, fsdp=2, hardware="dgx-h100"
    ),
    "llama-train-pp2-1f1b": estimate_case(
        L, "train", batch=4, seq=256, pp=2, microbatches=4, pp_schedule="1f1b", hardware="dgx-h100"
    ),
    "llama-train-pp2-gpipe": estimate_case(
        L, "train", batch=4, seq=256, pp=2, microbatches=4, pp_schedule="gpipe", hardware="dgx-h100"
    ),
    "llama-train-fsdp2-microbatches": estimate_case(
        L, "train", batch=4, seq=256, fsdp=2, microbatches=2, hardware="dgx-h100"
    ),
    "llama-train-tp2-fsdp2-realistic": estimate_case(
        L, "train", batch=2, seq=512, tp=2, fsdp=2, mode="realistic", hardware="dgx-h100"
    ),
    # compare and sweep
    "llama-compare-fusion": compare_case(
        L, "prefill", {"fusion": ["eager", "fused"]}, batch=2, seq=512
    ),
    "llama-compare-hardware": compare_case(
        L, "decode", {"hardware": ["h100-sxm", "a100-sxm"]}, batch=8, context=1024
    ),
    "llama-sweep-batch": sweep_case(L, "decode", "batch", [1, 8, 64], context=1024),
    "llama-sweep-seq": sweep_case(L, "prefill", "seq", [256, 1024], batch=1),
}


def render(result: Any) -> tuple[str, str]:
    """The result as JSON (sorted keys) and as the text a user reads."""
    from torchroof.render import text as shown

    if hasattr(result, "to_dict"):
        data = result.to_dict()
        text = shown.summary(result) + "\n\n" + shown.layer_table(result) + "\n"
    else:  # a Comparison or a Sweep
        estimates = (
            [v.estimate for v in result.variants]
            if hasattr(result, "variants")
            else [p.estimate for p in result.points]
        )
        data = {"estimates": [e.to_dict() for e in estimates]}
        table = shown.variants_table if hasattr(result, "variants") else shown.sweep_table
        text = table(result) + "\n"
    return json.dumps(data, sort_keys=True, indent=1, default=str) + "\n", text


def run_cases(names: list[str]) -> dict[str, tuple[str, str]]:
    out = {}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}", file=sys.stderr, flush=True)
        out[name] = render(CASES[name]())
    return out


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def digests(rendered: dict[str, tuple[str, str]]) -> dict[str, dict[str, str]]:
    return {n: {"json": sha(j), "text": sha(t)} for n, (j, t) in rendered.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("write", "check", "digest"))
    parser.add_argument("dir", nargs="?", type=Path)
    parser.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    args = parser.parse_args(argv)
    names = args.only or list(CASES)
    rendered = run_cases(names)
    if args.action == "write":
        if args.dir is None:
            parser.error("write needs a folder")
        args.dir.mkdir(parents=True, exist_ok=True)
        for name, (j, t) in rendered.items():
            (args.dir / f"{name}.json").write_text(j)
            (args.dir / f"{name}.txt").write_text(t)
        DIGESTS.parent.mkdir(parents=True, exist_ok=True)
        # --only rewrites those cases' digests and keeps every other case's
        kept = json.loads(DIGESTS.read_text()) if args.only and DIGESTS.exists() else {}
        kept.update(digests(rendered))
        DIGESTS.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(rendered)} cases to {args.dir} and their digests to {DIGESTS}")
        return 0
    if args.action == "check":
        if args.dir is None:
            parser.error("check needs a folder")
        differ = [
            f"{name}.{kind}"
            for name, (j, t) in rendered.items()
            for kind, now in (("json", j), ("txt", t))
            if (args.dir / f"{name}.{kind}").read_text() != now
        ]
    else:
        saved = json.loads(DIGESTS.read_text())
        differ = [
            f"{name}.{kind}"
            for name, now in digests(rendered).items()
            for kind in ("json", "text")
            if saved[name][kind] != now[kind]
        ]
    for d in differ:
        print(f"differs: {d}")
    same = len(rendered) - len({d.rsplit(".", 1)[0] for d in differ})
    print(f"{same} of {len(rendered)} cases identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
