"""What one engine token cost (`TokenStats`): time blocked per cause, bytes moved per kind, and
what each layer's policy did, per token-layer in `TOKEN_LAYER_FIELDS` layout (the pricing's
input, `moesub.pricing`; the same array `moesub.policy.token_layer_counts` builds from a scan)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from moesub.policy import STATUS_NAMES, TOKEN_LAYER_FIELDS

NUM_FIELDS = len(TOKEN_LAYER_FIELDS)
LANDED = TOKEN_LAYER_FIELDS.index("admissions")  # admissions landed at the token-layer


@dataclass
class TokenStats:
    """What one token cost, summed over layers (`layer_counts`: per layer)."""

    fetch_wait_s: float = 0.0  # blocked on synchronous copies
    admit_wait_s: float = 0.0  # blocked on background copies due now (admission="delay" only)
    prefetch_wait_s: float = 0.0  # blocked on prefetch copies not landed when needed (late)
    host_wait_s: float = 0.0  # blocked on the host's experts (reads + compute) after the fast
    # tier's experts of the same layer
    bytes_sync: int = 0  # synchronous fetches
    bytes_bg: int = 0  # background admissions installed during this token
    bytes_prefetch: int = 0  # prefetch copies installed during this token
    bytes_host: int = 0  # read from disk for the host's experts
    # what each layer's policy did (L, len(TOKEN_LAYER_FIELDS)) in `TOKEN_LAYER_FIELDS` order
    layer_counts: np.ndarray = field(default_factory=lambda: np.zeros((0, NUM_FIELDS), np.int64))
    mass: float = 0.0  # substituted gate mass, summed over layers
    admissions: int = 0  # admission requests made during this token
    admitted: int = 0  # background copies installed during this token
    admit_latency: int = 0  # tokens from request to install, summed over those installed
    prefetches: int = 0  # prefetch copies issued for this token's steps (step 1b insertions)
    prefetch_in_time: int = 0  # of those, landed before their layer's step
    syncs: int = 0  # host waits for the device (`HostSync`), router reads and token end

    @property
    def counts(self) -> np.ndarray:
        """Slots per status code (`STATUS_NAMES` order), summed over layers."""
        return self.layer_counts[:, : len(STATUS_NAMES)].sum(axis=0)


SCALAR_STATS = tuple(f.name for f in fields(TokenStats) if f.name != "layer_counts")
