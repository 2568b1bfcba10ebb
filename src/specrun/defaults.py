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
LOOKUP_MIN = 1  # shortest n-gram a prompt lookup matches
LOOKUP_MAX = 4  # longest n-gram a prompt lookup matches (tried first)
# The lookup drafter: "suffix" (spec/suffix.py: the longest match in this text and earlier
# outputs, ranked continuations) or "ngram" (spec/lookup.py: llama.cpp-style prompt lookup).
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
