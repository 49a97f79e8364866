"""The Python API on a real HF model: Llama-3-8B shapes, one 4096-token forward, H100 SXM.

    python examples/quickstart.py [--hardware h100-sxm] [--json llama.json]

Nothing is downloaded and no weights exist: the model is built on the meta device.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchroof
from torchroof.render import files, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--json", default=None, help="write the estimate here")
    args = parser.parse_args()

    config = LlamaConfig(  # Meta-Llama-3-8B
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")

    with torch.no_grad(), torchroof.trace() as t:  # records every aten op, allocates nothing
        model(ids)
    est = t.estimate(hardware=args.hardware)  # roofline on the chosen accelerator
    print(text.layer_table(est, collapse=True))  # per-layer time budget
    print()
    print(text.summary(est))
    print()
    print(text.kernel_table(est, top=8))
    if args.json:
        files.estimate_json(est, args.json)


if __name__ == "__main__":
    main()
