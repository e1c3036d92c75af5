"""Router traces in and out: the formats offloading runtimes write (docs/traces.md).

    from moesub.traces import read_trace, write_trace
    tr = read_trace(path, format=None, top_k=10)  # "rtrace01" | "mblt" | "expert_log" | "moesub"
    tr.ids          # int32 (T, L, k): selected experts per token and MoE layer, by rank
    tr.logits       # float32 (T, L, E), or None where the format holds ids only
    tr.num_experts, tr.top_k, tr.layers, tr.streams
    write_trace(path, "rtrace01", logits=z)          # or "mblt" with ids= (+ num_experts)

One module per format (`rtrace01`, `mblt`, `expert_log`; moesub's own router table is
`moesub.artefacts.load_trace`), the shared conventions in `base` (probabilities -> logits,
zero probabilities, incomplete records), fitz-tec's pin list in `pins`, and the chunked
simulation of a trace larger than memory in `chunked`.
"""

from moesub.traces.base import (
    INCOMPLETE,
    ZERO_LOGIT,
    RouterTrace,
    TraceChunk,
    TraceFormatError,
    logits_needed,
    rank_logits,
    ranked_topk,
)
from moesub.traces.chunked import check_grid, simulate_trace
from moesub.traces.formats import (
    FORMATS,
    WRITE_FORMATS,
    TraceWriter,
    detect_format,
    open_trace,
    read_trace,
    write_trace,
)
from moesub.traces.pins import PinList, frequency_order, read_pin_list, write_pin_list
from moesub.traces.rtrace01 import Rtrace01File

__all__ = [
    "FORMATS",
    "INCOMPLETE",
    "WRITE_FORMATS",
    "ZERO_LOGIT",
    "PinList",
    "RouterTrace",
    "Rtrace01File",
    "TraceChunk",
    "TraceFormatError",
    "TraceWriter",
    "check_grid",
    "detect_format",
    "frequency_order",
    "logits_needed",
    "open_trace",
    "rank_logits",
    "ranked_topk",
    "read_pin_list",
    "read_trace",
    "simulate_trace",
    "write_pin_list",
    "write_trace",
]
