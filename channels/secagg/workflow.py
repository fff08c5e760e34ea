"""Flower's SecAgg+ workflow on one round of the engine: the machinery of the ``secagg+`` channel's server half.

``channels/secagg/server.py`` (the channel) runs one round as follows, with the pieces of this module:

* :class:`RoundStrategy` - the legacy ``Strategy`` the workflow talks to: it targets exactly the engine's
  sampled partitions and captures the unmasked aggregate, the contributors, their counts and metrics;
* :class:`Workflow` - Flower's ``SecAggPlusWorkflow`` with one repair (clients that vanish before sharing
  their keys);
* :class:`ProtocolGrid` - the round's grid as the workflow sees it: fedsim's config on every message, the
  channel's settings and the transforms' extras on the message that trains, failures recorded, simulated
  dropouts;
* :func:`check_stage_reply` - what the workflow reads from each client's reply, checked before it uses it;
* :func:`as_model`, :func:`aggregate_metrics` - the aggregate in the model's dtypes, the contributors'
  metrics as one reply's.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import FitIns, Parameters, bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.serverapp import Grid

from fedsim.inprocess import DelegatingGrid
from fedsim.protocol import (
    ARRAYS,
    CHANNEL,
    CLIENT_ID_KEYS,
    CLIPPED,
    CODEC,
    CONFIG,
    NOISE_VARIANCE,
    NUM_EXAMPLES,
)
from fedsim.replies import InvalidReply
from fedsim.seams import RoundContext

#: Flower's stage names, in protocol order; a client dropping out "at" a stage never answers it
STAGES = (Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK)
STAGE_MEANING = {
    Stage.SETUP: "before the protocol starts (never sends its public keys)",
    Stage.SHARE_KEYS: "after sending its public keys, before sharing its key shares",
    Stage.COLLECT_MASKED_VECTORS: "after sharing its key shares, before training and sending its masked model",
    Stage.UNMASK: "after sending its masked model, before sending the shares that unmask the sum",
}


def fmt(x: float) -> str:
    return f"{x:g}"


class RoundStrategy(Strategy):
    """The legacy Strategy the workflow talks to, for one round: it samples nothing (the engine did)
    and aggregates nothing (the protocol did); it records what the protocol gives it."""

    def __init__(self, proxies: list[GridClientProxy], config: ConfigRecord):
        self.proxies, self.config = proxies, config
        self.results: list[tuple[Any, Any]] | None = None
        self.parameters: Parameters | None = None

    def initialize_parameters(self, client_manager: Any) -> Parameters | None:
        return None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list[tuple[Any, FitIns]]:
        ins = FitIns(parameters, dict(self.config.items()))  # fedsim's train ConfigRecord, the global arrays
        return [(p, ins) for p in self.proxies]

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[Parameters | None, dict]:
        # every FitRes carries the same, already unmasked aggregate
        self.results = list(results)
        self.parameters = results[0][1].parameters if results else None
        return self.parameters, {}

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None


class Workflow(SecAggPlusWorkflow):
    """Flower's workflow, plus one repair for clients that vanish before they have shared their keys.

    In Flower 1.41 such a client stays among the sampled nodes: at the unmask stage its neighbours are
    asked for shares of its key, which they never received (a ``KeyError`` on every neighbour) and the
    server waits for shares that do not exist, so the round halts however many clients survive. No
    mask involves such a client (a client masks only with the neighbours whose key shares it received),
    so after the setup and share-keys stages it is removed from the sampled set and from every
    neighbourhood, as if it had never been sampled. The last threshold check is kept for the report."""

    last_check: tuple[str, int, int] | None = None  # (stage, fewest active neighbours, threshold)

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self._forget_absent = False
        self._stage = ""

    def setup_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        return self._run(Stage.SETUP, True, super().setup_stage, grid, context, state)

    def share_keys_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        return self._run(Stage.SHARE_KEYS, True, super().share_keys_stage, grid, context, state)

    def collect_masked_vectors_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        return self._run(Stage.COLLECT_MASKED_VECTORS, False, super().collect_masked_vectors_stage, grid,
                         context, state)

    def unmask_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        return self._run(Stage.UNMASK, False, super().unmask_stage, grid, context, state)

    def _run(self, stage: str, forget: bool, step: Any, *args: Any) -> bool:
        self._stage, self._forget_absent = stage, forget
        try:
            return step(*args)
        finally:
            self._forget_absent = False

    def _check_threshold(self, state: Any) -> bool:
        if self._forget_absent:
            absent = set(state.sampled_node_ids) - set(state.active_node_ids)
            if absent:
                state.sampled_node_ids = set(state.sampled_node_ids) - absent
                for nid in list(state.nid_to_neighbours):
                    if nid in absent:
                        del state.nid_to_neighbours[nid]
                    else:
                        state.nid_to_neighbours[nid] = state.nid_to_neighbours[nid] - absent
        fewest = min((len(state.nid_to_neighbours[n] & state.active_node_ids) for n in state.sampled_node_ids),
                     default=0)
        self.last_check = (self._stage, fewest, int(state.threshold))
        if len(state.sampled_node_ids) < max(2, int(state.threshold)):
            return False  # (nearly) everyone vanished: Flower's per-node check would pass on an empty set
        return super()._check_threshold(state)


class ProtocolGrid(DelegatingGrid):
    """The round's grid as the SecAgg+ workflow sees it (see ``channels/secagg/server.py``'s docstring)."""

    def __init__(self, ctx: RoundContext, node_partition: Mapping[int, int], content: RecordDict,
                 dropped: Mapping[int, str], *, codec: str, max_weight: float, modulus_range: int):
        self.inner, self.ctx = ctx.grid, ctx
        self.codec, self.max_weight, self.modulus_range = codec, max_weight, modulus_range  # the channel's settings
        self.node_partition = dict(node_partition)
        self.content = content
        self.dropped = dict(dropped)  # partition -> the stage it drops out at
        self.failed: dict[int, str] = {}  # partition -> the stage it failed in
        self.replied: dict[str, list[int]] = {}  # stage -> partitions that answered it
        self.stage_seconds: dict[str, float] = {}
        self.messages = 0

    # ---- the Grid API: only send_and_receive carries the protocol; the rest is delegated
    def get_node_ids(self) -> list[int]:
        return list(self.node_partition)

    def _fail(self, partition: int, node: int, stage: str, reason: str) -> None:
        if partition in self.failed:
            return
        self.failed[partition] = stage
        self.ctx.engine.record_failure(self.ctx.record, self.ctx.round, node, f"secagg+ {stage}", reason,
                                       partition=partition)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        t0 = time.perf_counter()
        out: list[Message] = []
        stage = ""
        for m in messages:
            stage = str(m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE])
            node = m.metadata.dst_node_id
            p = self.node_partition[node]
            drop = self.dropped.get(p)
            if drop is not None and STAGES.index(stage) >= STAGES.index(drop):
                self._fail(p, node, stage, f"dropped out (simulated: channel.dropout_*) {STAGE_MEANING[drop]}")
                continue
            m.content[CONFIG] = self.content[CONFIG]  # the ClientApp reads the config (and the channel) here
            if stage == Stage.COLLECT_MASKED_VECTORS:  # the stage that trains: the channel's settings, extras
                m.content[CHANNEL] = ConfigRecord({CODEC: self.codec})
                for k, rec in self.content.items():
                    if k not in (CONFIG, ARRAYS):
                        m.content[k] = rec
            out.append(m)
        self.messages += len(out)
        replies = list(self.inner.send_and_receive(out, timeout=timeout)) if out else []
        got = {r.metadata.src_node_id for r in replies}
        for m in out:
            node = m.metadata.dst_node_id
            if node not in got:
                self._fail(self.node_partition[node], node, stage, f"no reply within {timeout} s")
        ok, valid = [], []
        for r in replies:
            node = r.metadata.src_node_id
            if node not in self.node_partition:
                continue  # not a node of this round (the workflow would fail on it)
            if r.has_error():
                self._fail(self.node_partition[node], node, stage, r.error.reason if r.error else "unknown error")
                continue
            try:
                check_stage_reply(stage, r, self)
            except InvalidReply as exc:  # as if it had dropped out of the protocol at this stage
                self._fail(self.node_partition[node], node, stage, f"invalid reply: {exc}")
                continue
            ok.append(self.node_partition[node])
            valid.append(r)
        self.replied[stage] = sorted(ok)
        self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + time.perf_counter() - t0
        return valid


# ---- checking each client's protocol replies -----------------------------------------------------------
def check_stage_reply(stage: str, msg: Message, grid: ProtocolGrid) -> None:
    """What Flower's workflow reads from one client's reply at ``stage``, checked against the channel's
    settings before the workflow uses it; raises :class:`InvalidReply` (the client then counts as
    dropped out at that stage, and the protocol recovers its masks from the others' shares).

    Checked: the records and value types each stage needs (public keys; destinations and ciphertexts
    of equal length; node ids and shares of equal length, naming nodes of the round); the masked
    vector (one weight factor and one integer array per model entry, in the model's shapes, each value
    in [0, modulus_range)) and the example count in the clear (a positive integer up to
    ``max_weight`` and ``federation.max_examples``). What cannot be checked: the values under the
    masks - a client can put any value in [0, modulus_range) there and shift the unmasked sum; Flower's
    SecAgg+ has no range proofs (docs/failures.md)."""
    rec = msg.content.config_records.get(RECORD_KEY_CONFIGS) if RECORD_KEY_CONFIGS in msg.content else None
    if rec is None:
        raise InvalidReply(f"the {stage} reply carries no SecAgg+ record")

    def listed(key: str, kind: type) -> list[Any]:
        v = rec.get(key)
        if not isinstance(v, list) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in v):
            raise InvalidReply(f"the {stage} reply's {key!r} must be a list of {kind.__name__}")
        return v

    if stage == Stage.SETUP:
        for key in (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2):
            if not isinstance(rec.get(key), bytes):
                raise InvalidReply(f"the setup reply's {key!r} must be bytes (a public key)")
    elif stage == Stage.SHARE_KEYS:
        if len(listed(Key.DESTINATION_LIST, int)) != len(listed(Key.CIPHERTEXT_LIST, bytes)):
            raise InvalidReply("the share_keys reply lists destinations and ciphertexts of different lengths")
    elif stage == Stage.UNMASK:
        nodes, shares = listed(Key.NODE_ID_LIST, int), listed(Key.SHARE_LIST, bytes)
        if len(nodes) != len(shares):
            raise InvalidReply("the unmask reply lists node ids and shares of different lengths")
        strangers = sorted(set(nodes) - set(grid.node_partition))
        if strangers:
            raise InvalidReply(f"the unmask reply holds shares of {len(strangers)} nodes not in the round")
    elif stage == Stage.COLLECT_MASKED_VECTORS:
        check_masked_vector(listed(Key.MASKED_PARAMETERS, bytes), grid)
        try:
            n = compat.recorddict_to_fitres(msg.content, True).num_examples
        except Exception as exc:  # noqa: BLE001 - a malformed FitRes
            raise InvalidReply(f"the reply's FitRes cannot be read ({type(exc).__name__}: {exc})") from None
        n = grid.ctx.engine.checks.check_count(n)
        if n > grid.max_weight:
            raise InvalidReply(f"num-examples = {n} is above channel.max_weight = {fmt(grid.max_weight)}")

def check_masked_vector(vector: list[bytes], grid: ProtocolGrid) -> None:
    shapes = [(1,)] + grid.ctx.engine.model.shapes  # Flower prepends the quantized weight factor
    if len(vector) != len(shapes):
        raise InvalidReply(f"the masked vector has {len(vector)} arrays, the model {len(shapes) - 1} (+ the weight)")
    for i, (b, shape) in enumerate(zip(vector, shapes)):
        try:
            a = bytes_to_ndarray(b)
        except Exception as exc:  # noqa: BLE001 - not an .npy array
            raise InvalidReply(f"masked array {i} cannot be decoded ({type(exc).__name__})") from None
        if a.dtype.kind not in "iu" or tuple(a.shape) != tuple(shape):
            raise InvalidReply(f"masked array {i} is {a.dtype} {list(a.shape)}, expected integers of shape "
                               f"{list(shape)}")
        if a.size and (int(a.min()) < 0 or int(a.max()) >= grid.modulus_range):
            raise InvalidReply(f"masked array {i} holds values outside [0, modulus_range = {grid.modulus_range})")

def as_model(arrays: list[np.ndarray], sent: Sequence[np.ndarray] | None) -> list[np.ndarray]:
    """Flower's float64 aggregate in the model's dtypes (integer buffers rounded)."""
    if sent is None:
        return [np.asarray(a) for a in arrays]
    out = []
    for a, s in zip(arrays, sent):
        s = np.asarray(s)
        a = np.asarray(a).reshape(s.shape)
        out.append(a.astype(s.dtype) if np.issubdtype(s.dtype, np.floating) else np.rint(a).astype(s.dtype))
    return out

def aggregate_metrics(results: list[Any]) -> dict[str, float]:
    """The contributors' metrics as one reply's: the example-weighted mean of each metric every one of
    them reports, the total example count, the clipped values summed, and the noise variance of the
    example-weighted mean (``sum_i (n_i/N)^2 sigma_i^2``: what a transform that compensates noise needs)."""
    n = np.array([float(r.num_examples) for r in results])
    total = float(n.sum())
    keys = set.intersection(*(set(r.metrics) for r in results)) if results else set()
    out: dict[str, float] = {NUM_EXAMPLES: int(total)}
    for k in sorted(keys - set(CLIENT_ID_KEYS)):
        vals = [r.metrics[k] for r in results]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            continue
        v = np.array(vals, dtype=np.float64)
        if k == CLIPPED:
            out[k] = float(v.sum())
        elif k == NOISE_VARIANCE:
            out[k] = float(np.sum((n / total) ** 2 * v)) if total > 0 else 0.0
        else:
            out[k] = float(np.dot(n, v) / total) if total > 0 else float(v.mean())
    return out
