"""GQA, MQA or full multi-head attention: what the KV-head count does to decode.

GQA (Ainslie et al. 2023), MQA (Shazeer 2019) and the KV crossover (Pope et al. 2022): the
same Llama-3-70B with 64 (MHA), 8 (its GQA) and 1 (MQA) KV heads, decoding at 8k context.

    python examples/gqa_comparison.py [--batch 16] [--context 8192]
"""

from __future__ import annotations

import argparse

from torchroof.render import text
from torchroof.studies import compare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-70b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=8192)
    args = parser.parse_args()
    result = compare(
        args.model,
        {"num_key_value_heads": [64, 8, 1]},
        regime="decode",
        batch=args.batch,
        context=args.context,
    )
    print(f"{args.model} decode, batch {args.batch}, context {args.context}, H100 SXM")
    print(text.variants_table(result))
    for variant in result.variants:
        est = variant.estimate
        print(
            f"{variant.label}: KV reads overtake weight reads at batch "
            f"{est.kv_crossover_batch:.0f}; B* (weights at the ridge) {est.ridge_batch:.0f}"
        )


if __name__ == "__main__":
    main()
