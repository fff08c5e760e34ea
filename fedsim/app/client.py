"""The fedsim ClientApp (Flower Message API).

Stateless apart from Flower's per-node ``Context.state``: the server sends the resolved fedsim
config (JSON) with every message, so the same ClientApp serves ``fedsim run`` (``run_simulation``),
``flwr run .``, ``fedsim attack`` and the in-process grid. Data and partitions are loaded once per
process (cached).

Messages handled (names in :mod:`fedsim.protocol`):

* ``QUERY``: reply with the node's partition id.
* ``CHANNEL_SETUP``: one step of the channel's setup exchange (e.g. key agreement), answered by the
  channel's client half.
* ``TRAIN``: the channel decodes the global model; local SGD through the defense pipeline (wrapped
  by the configured Flower mods); the channel encodes the new model. The reply carries it with
  ``num-examples``, ``partition-id`` and training/defense metrics. State that must persist
  (residuals, keys) is kept in ``Context.state`` and never put in a reply. A channel whose protocol
  has several stages wraps this handler (``ClientChannel.wrap_train``; SecAgg+ puts Flower's
  ``secaggplus_mod`` around it).
* ``EVALUATE``: the channel decodes the global model; reply with its loss and accuracy on the
  common test split (used when the server cannot read the model).
* ``CROSS_VALIDATE``: the message carries several models (each model's records suffixed ``#<k>``,
  each decoded by the channel like a global model); reply with each one's loss on the client's
  local validation split (``data.val_fraction``), in order (FedBoosting's cross-validation).
"""
from __future__ import annotations

import copy
import json
import traceback
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim.app import load_plugins
from fedsim.build import client_pipeline
from fedsim.client_state import restore_client_state, save_client_state
from fedsim.components import CHANNELS, FLOWER_MODS
from fedsim.defense import DefensePipeline
from fedsim.device import resolve_device
from fedsim.factories import client_data, client_validation_data, dataset_for, model_for
from fedsim.models.weights import set_weights
from fedsim.protocol import (
    CHANNEL_SETUP_ACTION,
    CONFIG,
    CROSS_VALIDATE_ACTION,
    CROSSVAL_LOSSES,
    CROSSVAL_MODELS,
    ERROR,
    ERROR_REASON,
    EVAL_ACCURACY,
    EVAL_DATA,
    EVAL_EXAMPLES,
    EVAL_LOSS,
    EVAL_SOURCE_ACCURACY,
    EXTRAS,
    FEDSIM_CONFIG,
    FINAL_TRAIN_LOSS,
    HOSTED_PARTITIONS,
    METRICS,
    NODE_PARTITION_ID,
    NUM_EXAMPLES,
    PARTITION_ID,
    PARTITIONS,
    REPORT_TRAIN_LOSS,
    RESUMED_AT,
    SERVER_ROUND,
    STATE_DEFENSES,
    STATE_MIRROR,
    VAL_EXAMPLES,
    arrays_record,
    decode_array,
    for_partition,
    hosted_partitions,
    recipe_of,
    split_model,
    split_partition,
)
from fedsim.seams import ClientChannel
from fedsim.training.evaluation import evaluate, source_accuracies
from fedsim.training.local import local_train
from fedsim.training.recipe import Recipe

load_plugins()


class _ClientApp(ClientApp):
    """Flower's ClientApp, pickled as a reference to this module's :data:`client_app`. Flower's Ray backend
    sends the app (inside its loader closure) with every message; by value, that is the handlers and their
    closures (14 kB) pickled in the server process and unpickled in the actor for every message (about 2 ms
    of CPU each, measured). By reference the actor uses the app its import of this module made, the same
    object a by-value copy rebuilt."""

    def __reduce__(self) -> tuple[Any, tuple]:
        return _the_client_app, ()


def _the_client_app() -> ClientApp:
    return client_app


client_app = _ClientApp()

Handler = Callable[[Message, Context], Message]


@lru_cache(maxsize=4)
def parse_config(text: str) -> dict[str, Any]:
    return json.loads(text)


def config_of(msg: Message) -> dict[str, Any]:
    return parse_config(str(msg.content[CONFIG][FEDSIM_CONFIG]))


def channel_for(cfg: dict[str, Any]) -> ClientChannel:
    """The client half of the configured channel: the one its server half names (``ServerChannel.client``),
    the channel given by registered name or by import reference."""
    name = (cfg.get("channel") or {}).get("name", "plain")
    return CHANNELS.lookup(name, "channel.name").client(cfg)


def wrap(handler: Handler, mods: Sequence[Callable]) -> Handler:
    """``handler`` wrapped by Flower mods (``mod(msg, context, call_next)``), first mod outermost."""
    for mod in reversed(list(mods)):
        handler = (lambda m, nxt: lambda msg, ctx: m(msg, ctx, nxt))(mod, handler)
    return handler


@lru_cache(maxsize=4)
def _cached_model(text: str) -> torch.nn.Module:
    return model_for(parse_config(text))


@lru_cache(maxsize=4)
def _cached_pipeline(text: str) -> DefensePipeline:
    return client_pipeline(parse_config(text))


@lru_cache(maxsize=4)
def _cached_channel(text: str) -> ClientChannel:
    return channel_for(parse_config(text))


def channel_of(msg: Message) -> ClientChannel:
    """The client half of the message's channel, built once per process and config (keyed by the config's
    text, like :func:`pipeline_for`) and shared by every message and partition this process serves. A
    client half keeps no client's state on itself: what lasts (keys, the model a Paillier client holds, an
    update waiting for the round's clip, SecAgg+'s protocol state) lives in ``ctx.state``, the partition's
    Flower ``Context.state``; a key is read from there for each message, never held by the channel, so no
    virtual client sees another's. Values a half sets on itself for one message (the Paillier half's
    decoded model, read by its ``encode`` of the same message) are set again by every message's ``decode``;
    a process serves its partitions one after another."""
    return _cached_channel(str(msg.content[CONFIG][FEDSIM_CONFIG]))


@lru_cache(maxsize=4)
def _cached_train(text: str) -> Handler:
    cfg = parse_config(text)
    mods = FLOWER_MODS.build_list(cfg.get("client", {}).get("flower_mods", []), "client.flower_mods")
    handler = wrap(_train, mods) if mods else _train
    return _cached_channel(text).wrap_train(handler)  # e.g. SecAgg+'s stages around training


def pipeline_for(msg: Message) -> DefensePipeline:
    """The defense pipeline of the message's config (the server transforms' client side, then
    ``[[defenses]]``): built once per process and config, and reused by every message and every partition
    this process serves. Keyed by the config's text - the whole config, since a defense is built with it
    (FedKL reads the seed) - so a warm Ray actor that a sweep hands a new variant builds that variant's
    pipeline anew. Sharing one pipeline is safe because a defense keeps nothing between messages on
    itself: what survives a round lives in ``ctx.state`` (this partition's Flower ``Context.state``), and
    the per-round values a defense sets on itself are set again by ``setup`` and its hooks every round
    (:class:`fedsim.defense.Defense`); partitions are served one after another in a process."""
    return _cached_pipeline(str(msg.content[CONFIG][FEDSIM_CONFIG]))


def model_to_train(msg: Message, cfg: dict[str, Any], adapts: bool) -> torch.nn.Module:
    """The model a message is trained on: built once per process and config and reused (every weight
    and buffer is overwritten from the message), unless a defense changes its structure."""
    return model_for(cfg) if adapts else _cached_model(str(msg.content[CONFIG][FEDSIM_CONFIG]))


def template_of(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's state entries (names, shapes, dtypes) for a channel to decode into."""
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def warm_up(cfg: dict[str, Any]) -> None:
    """Prepare a fresh client actor before its first message (:func:`fedsim.app.ray_runtime.prestart`):
    this module's imports (torch, Flower, the plugins) are done by then; load the config's dataset
    (cached for the run) and run one forward and backward pass of its model on two training samples,
    since torch's first backward in a process costs about a second. The torch RNG state is restored;
    a failure is left for the run's own messages to report."""
    try:
        with torch.random.fork_rng():
            ds = dataset_for(cfg)
            model = model_for(cfg)
            out = model(ds.x_train[:2])
            torch.autograd.grad(out.float().sum(), [p for p in model.parameters() if p.requires_grad])
    except Exception:  # noqa: BLE001 - the run's first message meets the same problem and reports it
        pass


def _partition_id(context: Context) -> int:
    return int(context.node_config[NODE_PARTITION_ID])


def serve_partitions(handler: Handler) -> Handler:
    """Run ``handler`` once per virtual client when a message addresses several partitions.

    A node that serves several partitions (``simulation.clients_per_node``) gets one message listing
    them under ``PARTITIONS``; each virtual client sees exactly what a node of its own would: a message
    with the shared records plus its own (suffix removed), and a Context whose partition id is its own
    and whose state holds only its own records (kept in the node's state under the same suffix). Its
    reply records come back suffixed; an exception becomes that virtual client's error record."""

    def run(msg: Message, context: Context) -> Message:
        conf = msg.content[CONFIG] if CONFIG in msg.content else None
        if conf is None or PARTITIONS not in conf:
            return handler(msg, context)
        parts = [int(p) for p in conf[PARTITIONS]]
        out = RecordDict()
        for p in parts:
            sub = RecordDict()
            for key, rec in msg.content.items():
                base, q = split_partition(key)
                if key == CONFIG:
                    sub[key] = ConfigRecord({k: v for k, v in rec.items() if k != PARTITIONS})
                elif q is None or q == p:
                    sub[base] = rec
            state = RecordDict({split_partition(k)[0]: v for k, v in context.state.items()
                                if split_partition(k)[1] == p})
            sub_ctx = Context(run_id=context.run_id, node_id=context.node_id, state=state,
                              node_config={**dict(context.node_config), NODE_PARTITION_ID: p},
                              run_config=context.run_config)
            sub_msg = Message(content=sub, metadata=copy.copy(msg.metadata))  # same sender, type, ids
            try:
                reply = handler(sub_msg, sub_ctx)
                if reply.has_error():
                    raise RuntimeError(reply.error.reason)
                for k, v in reply.content.items():
                    out[for_partition(k, p)] = v
            except Exception as exc:  # noqa: BLE001 - recorded as this virtual client's failure
                reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                out[for_partition(ERROR, p)] = ConfigRecord({ERROR_REASON: reason})
            for k in [k for k in context.state.keys() if split_partition(k)[1] == p]:
                del context.state[k]
            for k, v in sub_ctx.state.items():
                context.state[for_partition(k, p)] = v
        return Message(out, reply_to=msg)

    return run


def mirrored(handler: Handler) -> Handler:
    """Mirror this client's ``Context.state`` to the run folder after a successful exchange, and restore
    it in a resumed run (:mod:`fedsim.client_state`), when the server's message asks for it (runs that
    checkpoint). Applied per partition (under :func:`serve_partitions`): each virtual client mirrors
    its own state."""

    def run(msg: Message, context: Context) -> Message:
        conf = msg.content[CONFIG] if CONFIG in msg.content else None
        if conf is None or STATE_MIRROR not in conf:
            return handler(msg, context)
        folder, pid = str(conf[STATE_MIRROR]), _partition_id(context)
        if RESUMED_AT in conf:
            restore_client_state(context.state, folder, pid, int(conf[RESUMED_AT]))
        reply = handler(msg, context)
        if not reply.has_error():
            save_client_state(context.state, folder, pid, int(conf[SERVER_ROUND]) if SERVER_ROUND in conf else 0)
        return reply

    return run


@client_app.query()
def query(msg: Message, context: Context) -> Message:
    """Discovery: this node's partition id and the partitions it serves."""
    node = _partition_id(context)
    cfg = config_of(msg) if CONFIG in msg.content and FEDSIM_CONFIG in msg.content[CONFIG] else None
    hosted = [node]
    if cfg is not None:
        hosted = hosted_partitions(node, cfg["simulation"].get("clients_per_node", 1),
                                   cfg["federation"]["num_clients"])
    return Message(RecordDict({METRICS: MetricRecord({PARTITION_ID: node, HOSTED_PARTITIONS: hosted})}),
                   reply_to=msg)


@client_app.query(CHANNEL_SETUP_ACTION)
@serve_partitions
@mirrored
def channel_setup(msg: Message, context: Context) -> Message:
    return Message(channel_of(msg).handshake(msg, context), reply_to=msg)


@client_app.train()
@serve_partitions
@mirrored
def train(msg: Message, context: Context) -> Message:
    """Local training, wrapped by the Flower mods the config names (``[[client.flower_mods]]``), inside
    whatever the channel's client half wraps around it (``ClientChannel.wrap_train``). The wrapped handler
    is built once per process and config, like the pipeline: Flower's mods keep nothing on themselves
    (``secaggplus_mod`` keeps its protocol state in ``ctx.state``; ``LocalDpMod`` only its parameters)."""
    return _cached_train(str(msg.content[CONFIG][FEDSIM_CONFIG]))(msg, context)


def _train(msg: Message, context: Context) -> Message:
    conf = msg.content[CONFIG]
    cfg = config_of(msg)
    pid = _partition_id(context)
    rnd = int(conf[SERVER_ROUND])
    channel = channel_of(msg)
    x, y = client_data(cfg, pid)
    pipeline = pipeline_for(msg)
    model = model_to_train(msg, cfg, pipeline.adapts_model())
    template = template_of(model)
    names = list(template)
    set_weights(model, channel.decode(msg.content, context, template))
    state = {}
    if STATE_DEFENSES in context.state:
        state = {k: decode_array(v) for k, v in context.state[STATE_DEFENSES].items()}
    ds = dataset_for(cfg)
    incoming = {k: decode_array(a) for k, a in msg.content[EXTRAS].items()} if EXTRAS in msg.content else {}
    recipe = Recipe.from_mapping({**cfg["train"], **recipe_of(conf)})  # the round's rate, the rule's keys
    res = local_train(model, x, y, recipe, seed=cfg["seed"], round=rnd, client=pid,
                      pipeline=pipeline, state=state, device=resolve_device(cfg.get("device", "auto")),
                      public_data=(ds.x_root, ds.y_root), incoming=dict(incoming),
                      loss=cfg["train"].get("loss", "cross-entropy"))
    if res.state:
        context.state[STATE_DEFENSES] = ArrayRecord(OrderedDict((k, Array(np.ascontiguousarray(v)))
                                                                for k, v in res.state.items()))
    metrics = {NUM_EXAMPLES: res.num_examples, PARTITION_ID: pid,  # counts stay integers (local_steps)
               **{k: v if type(v) is int else float(v) for k, v in res.metrics.items()}}
    if REPORT_TRAIN_LOSS in conf and conf[REPORT_TRAIN_LOSS]:  # the rule asks (FedBoosting's T)
        set_weights(model, res.weights)
        metrics[FINAL_TRAIN_LOSS] = evaluate(model, x, y, resolve_device(cfg.get("device", "auto")))[0]
    content = RecordDict({**channel.encode(res.weights, names, context), METRICS: MetricRecord(metrics)})
    if res.extras:
        content[EXTRAS] = arrays_record(list(res.extras), list(res.extras.values()))
    return Message(content, reply_to=msg)


@client_app.evaluate()
@serve_partitions
def evaluate_global(msg: Message, context: Context) -> Message:
    """The global model's loss and accuracy on the common test split (the channel decodes it), or on the
    client's own data when the message asks for it (``EVAL_DATA = "local"``: client-side evaluation)."""
    cfg = config_of(msg)
    model = model_to_train(msg, cfg, adapts=False)
    set_weights(model, channel_of(msg).decode(msg.content, context, template_of(model)))
    device = resolve_device(cfg.get("device", "auto"))
    per_source: list[float] = []
    if str(msg.content[CONFIG].get(EVAL_DATA, "test")) == "local":
        x, y = client_data(cfg, _partition_id(context))
    else:
        ds = dataset_for(cfg)
        x, y = ds.x_test, ds.y_test
        per_source = source_accuracies(model, ds, device)
    loss, acc = evaluate(model, x, y, device)
    metrics = {EVAL_LOSS: loss, EVAL_ACCURACY: acc, EVAL_EXAMPLES: len(y), PARTITION_ID: _partition_id(context)}
    if per_source:
        metrics[EVAL_SOURCE_ACCURACY] = per_source
    return Message(RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)


@client_app.evaluate(CROSS_VALIDATE_ACTION)
@serve_partitions
def cross_validate(msg: Message, context: Context) -> Message:
    """Each model the message carries (``CROSSVAL_MODELS`` of them, records suffixed ``#<k>``, decoded by
    the channel) evaluated on this client's local validation split: the losses, in order."""
    cfg = config_of(msg)
    pid = _partition_id(context)
    count = int(msg.content[CONFIG][CROSSVAL_MODELS])
    x, y = client_validation_data(cfg, pid)
    if len(y) == 0:
        raise ValueError(f"client {pid} has no validation data (data.val_fraction = "
                         f"{cfg['data'].get('val_fraction', 0.0)}, {len(client_data(cfg, pid)[1])} training samples)")
    channel = channel_of(msg)
    model = model_to_train(msg, cfg, adapts=False)
    template = template_of(model)
    device = resolve_device(cfg.get("device", "auto"))
    models: list[RecordDict] = [RecordDict() for _ in range(count)]
    for key, rec in msg.content.items():
        base, k = split_model(key)
        if k is not None:
            if not 0 <= k < count:
                raise ValueError(f"cross-validation record {key!r} names model {k} of {count}")
            models[k][base] = rec
    losses = []
    for k, content in enumerate(models):
        if not list(content.keys()):
            raise ValueError(f"cross-validation message carries no records for model {k}")
        set_weights(model, channel.decode(content, context, template))
        losses.append(float(evaluate(model, x, y, device)[0]))
    return Message(RecordDict({METRICS: MetricRecord({CROSSVAL_LOSSES: losses, VAL_EXAMPLES: len(y),
                                                      PARTITION_ID: pid})}), reply_to=msg)
