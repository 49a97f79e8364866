"""How long a trace may run before capture stops it (the one definition of each limit:
``torchroof.config.workload`` makes them knobs, ``torchroof.capture.mode`` enforces them)."""

# The op budget. Every aten op a capture sees counts, recorded or not (``unrecorded()``,
# SDPA's hidden decomposition, the math-path backward flash replaces), so a loop that
# runs under ``unrecorded()`` is stopped too. Measured (aten ops of one captured step,
# transformers 5.24): Llama-3.1-405B train 36,865 (28,172 recorded; 61,707 with the
# traced Muon step, 48,639 with Adafactor), DeepSeek-V3 train 30,286, Llama-3-70B train
# 23,433; the zoo's largest step at seq 32 is LongCat-Flash train (~600k: its expert
# loop runs every hit expert). Models that loop over tokens in Python (the reference
# paths of Mamba, ~14 ops per token and layer, and RWKV, ~31) reach millions at seq 4096:
# Mamba prefill ~1.9M, train ~6M; RWKV train (~12M) needs a larger budget. 10M leaves
# 270x over the biggest dense step and room for most of those. A recorded op holds
# ~1.2 KB, so the budget alone would let a runaway loop grow to ~12 GB (~40 min at the
# ~4k ops/s of meta); ``max_item_answers`` below stops the usual runaway (a loop on
# ``.item()``) long before that.
DEFAULT_MAX_OPS = 10_000_000
# Meta ``.item()`` / ``bool()`` / ``tolist()`` answers in one module call: none of them
# with a module entered or left in between. A real step answers a few (a mask check, an
# MoE's expert list): at most 4 in any architecture of the zoo (prefill at 512 tokens,
# train at 64; DBRX's expert loop). A ``while x.abs().max() > tol:`` loop answers one
# per iteration forever: 10,000 answers of its 6-op body are 60k ops, ~0.15 GB, ~8 s.
# Answers inside a torch.optim step do not count: an optimizer that reads its step
# counter per parameter (Adafactor: 2 answers per parameter, 2,274 for Llama-3.1-405B)
# is bounded by the parameters, and ``max_ops`` still bounds it.
DEFAULT_MAX_ITEM_ANSWERS = 10_000
# Decoder layers a config may ask for: refused above this before anything is built (a
# million layers held ~8 GB of meta modules before any output). The deepest shipped or zoo
# config has 126 (Llama-3.1-405B); 1,024 leaves 8x over it.
DEFAULT_MAX_LAYERS = 1_024
# Ranks one step may span (tp x dp x fsdp x cp x pp): rank 0 is traced, but torch's
# init_device_mesh walks every sub-group of every mesh dimension (world / size of each).
# torchroof.parallel.program creates only rank 0's groups, yet the walk stays linear in the world:
# ~1.3 s per 10,000 ranks (tp=2 x dp=100,000: 13 s). The largest published runs use ~100k
# GPUs; 2**17 = 131,072 covers them and bounds the walk at ~15 s.
MAX_WORLD_SIZE = 2**17
# ... and in a whole trace, this many times ``max_item_answers`` (outside optimizer steps):
# a ``while`` loop whose body calls a submodule enters and leaves a module every iteration,
# which resets the per-call count (it grew to 3.6 GB in 180 s); a real step answers a few
# per layer (a few hundred for the deepest models), so 2 x 10,000 stops only runaways.
ITEM_ANSWERS_PER_TRACE_FACTOR = 2
