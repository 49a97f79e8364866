"""Two IO algorithms: FlashAttention's three accountings of Q and chunked
cross-entropy's peak logits memory. Both leave W alone and change Q.

Standard attention (Dao et al. 2022, Algorithm 0) materialises S and P,
W = 4N²d, Q = 4s(Nd + N²), I = Nd/(s(N + d)) -> d/s.
FlashAttention is an IO algorithm (Dao et al. 2022): compulsory Q = 4sNd, I = N/s; tiled (each
block of B_r query rows re-reads all of K and V) Q = s·Nd + s·(N/B_r)·2Nd + s·Nd,
I = 4N²d / [s(2Nd + 2N²d/B_r)] -> 2B_r/s. Per head; causal masking halves W and Q alike
and leaves I where it is. torchroof/hierarchy.attention_levels counts the same tiled bytes
at the L2 boundary with B_r = 128.
Large-vocabulary logits (Wijmans et al. 2024): the fp32 logits are 4·N_t·V bytes per copy;
cross-entropy moves ~4·4·N_t·V bytes (read logits, write softmax, read back, write grad) at
I ~ 6/16; chunking C token rows at a time keeps 4·C·V and folds that traffic (and the head
GEMM's N_t·V output write) into on-chip work.

CLI: ``torchroof lab flash --seq 4096 --head-dim 128`` and ``torchroof lab cross-entropy
--tokens 8192 --vocab 100000 --chunk 1024``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchroof.hardware import HardwareSpec, get, spec_dtype
from torchroof.labs.explore import itemsize
from torchroof.timing.hierarchy import FP32_BYTES

CE_FLOPS_PER_LOGIT = 6  # I_CE ~ 6 FLOPs / 16 bytes
CE_PASSES = 4  # read logits, write softmax, read it back, write the gradient


@dataclass(frozen=True)
class AttentionBounds:
    """One head of attention over N keys and queries, head dim d, s bytes per element."""

    seq: int  # N
    head_dim: int  # d
    block_rows: int  # B_r
    itemsize: int  # s

    @property
    def flops(self) -> int:
        """W = 4N²d: QK^T and PV, 2N²d each."""
        return 4 * self.seq**2 * self.head_dim

    @property
    def naive_bytes(self) -> int:
        """4s(Nd + N²): Q, K, V, O once, S and P each written and read back."""
        n, d = self.seq, self.head_dim
        return 4 * self.itemsize * (n * d + n * n)

    @property
    def compulsory_bytes(self) -> int:
        """4sNd: Q, K, V read once, O written once."""
        return 4 * self.itemsize * self.seq * self.head_dim

    @property
    def query_blocks(self) -> int:
        """N/B_r (a partial last block still streams all of K and V)."""
        return math.ceil(self.seq / self.block_rows)

    @property
    def tiled_bytes(self) -> int:
        """s·Nd (Q) + s·(N/B_r)·2Nd (K, V re-read per query block) + s·Nd (O)."""
        nd = self.seq * self.head_dim
        return self.itemsize * (nd + self.query_blocks * 2 * nd + nd)

    def intensity(self, which: str) -> float:
        size = {
            "naive": self.naive_bytes,
            "tiled": self.tiled_bytes,
            "compulsory": self.compulsory_bytes,
        }[which]
        return self.flops / size

    @property
    def naive_limit(self) -> float:
        """d/s, naive attention's plateau as N grows."""
        return self.head_dim / self.itemsize

    @property
    def tiled_limit(self) -> float:
        """2B_r/s, the tiled kernel's plateau as N grows."""
        return 2 * self.block_rows / self.itemsize

    def lines(self) -> list[str]:
        return [
            f"attention, one head: N = {self.seq}, d = {self.head_dim}, B_r = "
            f"{self.block_rows}, s = {self.itemsize} B; W = {self.flops / 1e9:.3f} GFLOP",
            f"naive: Q = {self.naive_bytes / 1e6:.2f} MB, I = {self.intensity('naive'):.1f} "
            f"(-> d/s = {self.naive_limit:g})",
            f"tiled: Q = {self.tiled_bytes / 1e6:.2f} MB, I = {self.intensity('tiled'):.1f} "
            f"(-> 2B_r/s = {self.tiled_limit:g})",
            f"compulsory: Q = {self.compulsory_bytes / 1e6:.2f} MB, "
            f"I = {self.intensity('compulsory'):.1f} (= N/s, grows with N)",
        ]


def attention_bounds(
    seq: int, head_dim: int = 128, block_rows: int = 128, dtype: str = "bf16"
) -> AttentionBounds:
    """Attention's three accountings of Q (naive, tiled, compulsory) at one sequence length."""
    for name, value in (("seq", seq), ("head_dim", head_dim), ("block_rows", block_rows)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return AttentionBounds(seq, head_dim, block_rows, itemsize(dtype))


@dataclass(frozen=True)
class ChunkedCrossEntropy:
    """The LM head and its loss for N_t tokens, vocabulary V, model width d, chunks of C."""

    tokens: int  # N_t
    vocab: int  # V
    chunk: int  # C (at most N_t)
    d_model: int  # d
    dtype: str
    itemsize: int  # s of the activations and the head weight
    bandwidth_bytes_per_s: float

    @property
    def chunks(self) -> int:
        return math.ceil(self.tokens / self.chunk)

    @property
    def materialised_peak_bytes(self) -> int:
        """4·N_t·V: one fp32 copy of all the logits."""
        return FP32_BYTES * self.tokens * self.vocab

    @property
    def chunked_peak_bytes(self) -> int:
        """4·C·V: the fp32 logits of one chunk."""
        return FP32_BYTES * self.chunk * self.vocab

    @property
    def peak_ratio(self) -> float:
        return self.materialised_peak_bytes / self.chunked_peak_bytes

    @property
    def cross_entropy_bytes(self) -> int:
        """4 passes x 4 B x N_t·V: the separate low-intensity kernel chunking removes."""
        return CE_PASSES * FP32_BYTES * self.tokens * self.vocab

    @property
    def cross_entropy_intensity(self) -> float:
        return CE_FLOPS_PER_LOGIT / (CE_PASSES * FP32_BYTES)

    @property
    def head_flops(self) -> int:
        return 2 * self.tokens * self.d_model * self.vocab

    @property
    def head_bytes(self) -> int:
        """s(N_t·d + d·V + N_t·V): the materialised head GEMM."""
        n, d, v = self.tokens, self.d_model, self.vocab
        return self.itemsize * (n * d + d * v + n * v)

    @property
    def logits_write_bytes(self) -> int:
        """s·N_t·V: the head GEMM's output term, gone when chunked."""
        return self.itemsize * self.tokens * self.vocab

    @property
    def weight_reread_bytes(self) -> int:
        """NB: each chunk's GEMM streams the d x V head weight again, so
        chunking adds (chunks - 1)·s·d·V unless L2 holds the weight."""
        return (self.chunks - 1) * self.itemsize * self.d_model * self.vocab

    @property
    def traffic_removed_bytes(self) -> int:
        return self.cross_entropy_bytes + self.logits_write_bytes

    @property
    def net_traffic_saved_bytes(self) -> int:
        return self.traffic_removed_bytes - self.weight_reread_bytes

    def lines(self) -> list[str]:
        beta = self.bandwidth_bytes_per_s
        return [
            f"LM head + cross-entropy: N_t = {self.tokens}, V = {self.vocab}, d = "
            f"{self.d_model}, {self.dtype}, chunk C = {self.chunk}",
            f"head GEMM: {self.head_flops / 1e12:.2f} TFLOP over {self.head_bytes / 1e9:.2f} GB, "
            f"I = {self.head_flops / self.head_bytes:.0f}",
            f"peak logits memory: materialised 4·N_t·V = {self.materialised_peak_bytes / 1e9:.2f}"
            f" GB, chunked 4·C·V = {self.chunked_peak_bytes / 1e9:.3f} GB "
            f"({self.peak_ratio:.1f}x smaller)",
            f"cross-entropy kernel removed: {self.cross_entropy_bytes / 1e9:.2f} GB at "
            f"I = {self.cross_entropy_intensity:.3f} ({self.cross_entropy_bytes / beta * 1e3:.2f}"
            " ms at HBM bandwidth)",
            f"head GEMM loses its N_t·V output write: {self.logits_write_bytes / 1e9:.2f} GB",
            f"head weight re-read per chunk: +{self.weight_reread_bytes / 1e9:.2f} GB "
            f"({self.chunks} chunks, unless L2 holds it)",
            f"net traffic saved: {self.net_traffic_saved_bytes / 1e9:.2f} GB "
            f"({self.net_traffic_saved_bytes / beta * 1e3:.2f} ms)",
        ]


def chunked_cross_entropy(
    tokens: int,
    vocab: int,
    chunk: int,
    *,
    d_model: int = 4096,
    dtype: str = "bf16",
    hardware: str | HardwareSpec = "h100-sxm",
) -> ChunkedCrossEntropy:
    """Chunked cross-entropy's logits memory and traffic (defaults N_t = 8192, d = 4096,
    C = 1024) at one vocabulary size."""
    for name, value in (("tokens", tokens), ("vocab", vocab), ("chunk", chunk), ("d", d_model)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    spec = get(hardware)
    return ChunkedCrossEntropy(
        tokens,
        vocab,
        min(chunk, tokens),
        d_model,
        spec_dtype(dtype),
        itemsize(dtype),
        spec.hbm_bytes_per_s.value,
    )
