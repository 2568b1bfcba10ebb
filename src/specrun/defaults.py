"""Every default of a user-facing setting, defined once. The command line's options, SpecConfig,
SamplingParams, the session's ModelOptions, bench and the probe behind `models check` all read
these, so what `models check` measures is what `generate` runs."""

from __future__ import annotations

# -- speculation -------------------------------------------------------------------------------
MODE = "auto"
DRAFT_MAX = 4  # longest draft when the pair names none
# auto picks its K per step from measured costs, so its default cap only bounds that choice: the
# pair's draft_max (tuned for the draft model alone), raised to this. Default pair, 128 tokens,
# medians of 3 (bench/modes_compare.py): K <= 8 against K <= 4 went 1.49 -> 1.55x on code,
# 1.44 -> 1.54x on a Stack class, 1.50 -> 1.54x on a code edit, 2.21 -> 2.36x on a summary,
# 2.54 -> 2.99x on QA over a passage; a story 1.00 -> 0.98x (0.99 -> 0.98x in model time).
AUTO_DRAFT_MAX = 8
DRAFT_MIN = 0
# The draft stops when its top probability falls below this (0 = never): measured, fewer wasted
# draft steps at greedy on the default pair (llama.cpp's --spec-draft-p-min).
DRAFT_P_MIN = 0.6
VERIFY = "rejection"  # temp > 0: rejection sampling (exact); "match" = sample-and-match
# The shortest match a lookup drafter proposes from (--lookup-min): 2 for --mode lookup and
# hybrid, 1 under auto, which prices each match length from its own acceptance. A one-token match
# is a weak guess (its follower right ~30% of the time on open text) and a 2-row pass costs 1.3-1.6
# target steps on a CPU in every format but F32 (README: V(n)). Replayed over recorded greedy runs
# of the default pair, 16 workloads (bench/suffix_sim.py; V(n) of a 2-core Zen 3: F16 its cached
# calibration, V(3) 1.96, dearer than fresh measurements' 1.46-1.70; Q4_K_M and F32 the README's
# table), geo-means of the speed-up over plain decoding, minimum 1 -> 2: --mode lookup (the
# suffix drafter) F16 1.105 -> 1.132, Q4_K_M 1.095 -> 1.125, F32 1.315 -> 1.318; the n-gram
# drafter F16 0.86 -> 1.06, Q4_K_M 0.92 -> 1.11, F32 1.17 -> 1.28. Where a pass of n rows costs 1 + 0.1 (n - 1) (a
# GPU's cheap batches) 2 loses: the suffix drafter 1.497 -> 1.458, auto 1.475 -> 1.444 (auto at
# this CPU's prices: within 0.4% either way).
LOOKUP_MIN = 2
LOOKUP_MIN_AUTO = 1
LOOKUP_MAX = 4  # longest n-gram a prompt lookup matches (tried first)
# The lookup drafter: "suffix" (decoding/suffix.py: the longest match in this text and earlier
# outputs, ranked continuations) or "ngram" (decoding/lookup.py: llama.cpp-style prompt lookup).
LOOKUP_KIND = "suffix"
# The suffix drafter's longest proposal: max(--draft-max, this). A long match is cheap to verify
# (a 17-row pass ~2.6 target steps on a 2-core CPU, F32) and --draft-max is the draft model's K.
LOOKUP_DRAFT_MAX = 16

# -- sampling ----------------------------------------------------------------------------------
TEMP = 0.0  # greedy: the target's own output, token for token
TOP_K = 40
TOP_P = 0.95
MIN_P = 0.05

# -- placement ---------------------------------------------------------------------------------
CTX = 4096
BATCH = 512
FLASH_ATTN = "auto"
CACHE_TYPE = "f16"
