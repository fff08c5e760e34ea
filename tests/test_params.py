"""One way to declare a component's parameters and limits (fedsim.params), presets, the attacks'
validate_config hook, and the components' lifecycle with state() failing closed (fedsim.lifecycle.Component)."""
from __future__ import annotations

import json
from typing import Annotated

import pytest
from conftest import make_small_cfg

from attacks import ATTACKS, build_attack
from attacks.dlg import DLG
from attacks.regularised import RegularisedInvertingGradients
from fedsim.app.runner import run_experiment
from fedsim.checkpoint import CHECKPOINT, resume_blocker
from fedsim.components import STRATEGIES, ConfigError, check_value
from fedsim.config import SCHEMA
from fedsim.lifecycle import Component
from fedsim.params import CountOrFraction, OneOf, Range
from fedsim.seams import AggregationRule, PlainChannel, WeightedSumRule
from strategies.fedavg import FedAvg


# ----------------------------------------------------------------------------------- constraints
@pytest.mark.parametrize("value, annotation, message", [
    (0, Annotated[int, Range(1)], "k must be >= 1, got 0"),
    (0.0, Annotated[float, Range(0, open_low=True)], "k must be > 0, got 0.0"),
    (1.0, Annotated[float, Range(0, 1, open_high=True)], "k must be in [0, 1), got 1.0"),
    (-1, Annotated[float | None, Range(0)], "k must be >= 0, got -1"),
    ("c", Annotated[str, OneOf("a", "b")], "k must be one of ['a', 'b'], got 'c'"),
    (True, Annotated[int, Range(1)], "k must be an integer, got True"),  # the type first, then the limits
    (4, Annotated[int | float, CountOrFraction(3, of="x", odd=True)],
     "k must be an odd integer >= 3 or a fraction in (0, 1] of x, got 4"),
    (1.5, Annotated[int | float, CountOrFraction(3, of="x")],
     "k as a number with a decimal point is a fraction of x and must be in (0, 1], got 1.5 (write an integer for a count)"),
])
def test_one_check_gives_one_line_naming_the_key(value, annotation, message):
    with pytest.raises(ConfigError) as err:
        check_value("k", value, annotation)
    assert str(err.value) == message
    check_value("k", None, Annotated[float | None, Range(0)])  # unset is not limited


def test_the_schema_uses_the_same_constraint_objects():
    assert any(isinstance(c, Range) for c in SCHEMA["federation.rounds"].constraints)
    assert any(isinstance(c, OneOf) for c in SCHEMA["data.partition"].constraints)


@pytest.mark.parametrize("sets, message", [
    (["federation.rounds=0"], "federation.rounds must be >= 1, got 0"),
    (["train.momentum=1.0"], "train.momentum must be in [0, 1), got 1.0"),  # was a hand check in validate()
    (["federation.max_update_norm=0"], "federation.max_update_norm must be > 0, got 0"),
    (['attack={name="grnn", params={grnn={momentum=1.0}}}'],
     "attack.params.grnn.momentum must be in [0, 1), got 1.0"),
    (['attack={name="cpl", params={cpl={labels="joint"}}}'],
     "attack.params.cpl.labels must be one of ['idlg', 'known'], got 'joint'"),
    (['defenses=[{name="prune", ratio=1.5}]'], "defenses[0].ratio must be in [0, 1], got 1.5"),
    (['strategy={name="flwr-fedadam", eta=0.0}'], "strategy.eta must be in (0, inf), got 0.0"),
    # hand-written constructor checks before issue 28's last step, now constraints in the signatures
    (['defenses=[{name="lrp", gamma=0.0}]'], "defenses[0].gamma must be in (0, 1], got 0.0"),
    (['defenses=[{name="gaussian-noise", sigma=0.1, delta=1.0}]'], "defenses[0].delta must be in (0, 1), got 1.0"),
    (['defenses=[{name="fedkl", evaluate="sometimes"}]'],
     "defenses[0].evaluate must be one of ['both', 'before', 'after', 'none'], got 'sometimes'"),
    (['transforms=[{name="mp-compensation", variance="median"}]'],
     "transforms[0].variance must be one of ['weighted-mean', 'paper'], got 'median'"),
    (['strategy={name="fedboosting", p_hat=0.5}'],  # a constraint's `why` ends the line
     "strategy.p_hat must be in (0.5, 1], got 0.5 (the model's own share of its fused copy must be the largest)"),
    (['channel={name="secagg+", quantization_range=1}'],
     "channel.quantization_range must be in [2, 2147483648), got 1 (Flower quantizes to int32)"),
    (['channel={name="paillier", encrypt="gradients"}'],
     "channel.encrypt must be one of ['update', 'model'], got 'gradients'"),
    (['strategy={name="flwr-dp-server-fixed", noise_multiplier=1.0, clipping_norm=1.0, '
      'rule={name="flwr-fedadam", eta=0.0}}'], "strategy.rule.eta must be in (0, inf), got 0.0"),
])
def test_config_limits_name_the_key(sets, message):
    with pytest.raises(ConfigError) as err:
        make_small_cfg(*sets)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_attack_parameters_are_checked_where_they_are_declared():
    with pytest.raises(ConfigError, match=r"^attack\.iterations must be >= 1, got 0$"):
        build_attack("ig", iterations=0)  # declared once (Annotated), checked once
    with pytest.raises(ConfigError, match=r"^attack\.muted must be a list of parameter-name patterns"):
        build_attack("ig-bn", muted=[1])


def test_components_built_in_python_are_checked_as_config_entries_are():
    """One mechanism (fedsim.components.Declared, the base of every component kind): building a component
    directly checks the arguments given against its declaration, with the config loader's one line."""
    from attacks.base import Attack
    from clients.slicing import LocalRandomPerturbation
    from strategies.fedboosting import FedBoosting

    for build, message in [(lambda: DLG(iterations=0), "dlg.iterations must be >= 1, got 0"),
                           (lambda: ATTACKS["idlg"](iterations=0), "idlg.iterations must be >= 1, got 0"),
                           (lambda: DLG(labels="soft"), "dlg.labels must be one of"),
                           (lambda: LocalRandomPerturbation(root_bias=1.5), "lrp.root_bias must be in [0, 1], got 1.5"),
                           (lambda: FedBoosting(shares="sorted"), "fedboosting.shares must be one of")]:
        with pytest.raises(ConfigError) as err:
            build()
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert DLG(iterations=5).iterations == 5  # what is valid still builds

    class Mine(Attack):  # a user's attack: the same check, with no code of its own
        name = "mine"

        def __init__(self, steps: Annotated[int, Range(1)] = 10, lr: Annotated[float, Range(0, open_low=True)] = 0.1):
            self.steps, self.lr = steps, lr

    class Longer(Mine):  # checked once, by the constructor called, under its own name
        name = "longer"

        def __init__(self, steps: Annotated[int, Range(100)] = 100, **kwargs):
            super().__init__(steps=steps, **kwargs)

    with pytest.raises(ConfigError, match=r"^mine\.lr must be > 0, got 0\.0$"):
        Mine(5, 0.0)  # positional arguments too
    with pytest.raises(ConfigError, match=r"^longer\.steps must be >= 100, got 50$"):
        Longer(steps=50)
    with pytest.raises(ConfigError, match=r"^longer\.lr must be > 0"):
        Longer(lr=-1.0)  # a base's parameter passed through **kwargs
    assert Longer(lr=0.5).steps == 100


# ----------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name, base, defaults", [
    ("idlg", DLG, {"labels": "idlg"}),
    ("dlg-original", DLG, {"init": "randn", "iterations": 6000, "restarts": 1, "patience": 6000}),
    ("ig-fr", RegularisedInvertingGradients, {"features": 0.1, "image_prior": True, "prior_width": 8,
                                              "prior_depth": 1}),
])
def test_presets_are_their_base_with_other_defaults(name, base, defaults):
    cls = ATTACKS[name]
    assert cls.preset_of is base and cls.preset_defaults == defaults
    params, base_params = ATTACKS.params(cls), ATTACKS.params(base)
    assert list(params) == list(base_params)  # the same parameters, declared once (in the base)
    for k, p in params.items():
        assert p.default == defaults.get(k, base_params[k].default)
        assert p.annotation == base_params[k].annotation  # ... with the same constraints
    attack = build_attack(name)
    assert type(attack).name == name and isinstance(attack, base)
    assert all(getattr(attack, k) == v for k, v in defaults.items())
    assert build_attack(name, restarts=3).restarts == 3  # every parameter can still be set
    with pytest.raises(ConfigError, match=r"attack\.restarts must be >= 1"):
        build_attack(name, restarts=0)


def test_ig_fr_keeps_its_switch():
    assert ATTACKS["ig-fr"].require_bn is False and ATTACKS["ig-bn"].require_bn is True
    assert "preset_of" not in vars(ATTACKS["cpl"])  # CPL adds a regulariser: a subclass, not a preset


# ----------------------------------------------------------------------------------- attacks' validate_config
def test_an_attack_refuses_a_config_it_cannot_attack():
    cfg = make_small_cfg()
    with pytest.raises(ValueError, match="model.imprint_bins"):
        build_attack("robbing").validate_config(cfg)
    with pytest.raises(ValueError, match="robbing-imprint"):
        build_attack("robbing").validate_config({**cfg, "model": {**cfg["model"], "imprint_bins": 16}})
    with pytest.raises(ConfigError) as err:
        make_small_cfg('attack={name="robbing"}')
    assert str(err.value).startswith("attack.name 'robbing': ") and "model.imprint_bins" in str(err.value)


# ----------------------------------------------------------------------------------- lifecycle: state() fails closed
class _Counting(WeightedSumRule):
    """A user's rule whose weights depend on earlier rounds but that forgot state()."""

    name = "test-counting"

    def __init__(self) -> None:
        self.seen = 0

    def weights(self, ctx, replies):
        self.seen += len(replies)
        return [float(self.seen + i) for i in range(len(replies))]


class _HalfDone(_Counting):
    name = "test-half-done"

    def state(self):
        return {"seen": self.seen}  # ... but no load_state()


def test_state_fails_closed():
    assert issubclass(AggregationRule, Component)
    with pytest.raises(NotImplementedError, match="stateless = True"):
        _Counting().state()
    assert FedAvg().state() == {} and PlainChannel().state() == {}  # built-ins say they are stateless
    assert resume_blocker(PlainChannel(), FedAvg(), [], []) is None
    assert "strategy 'test-counting' cannot be checkpointed" in resume_blocker(PlainChannel(), _Counting(), [], [])
    half = _HalfDone()
    half.seen = 3
    assert "no load_state()" in resume_blocker(PlainChannel(), half, [], [])


def test_a_rule_that_forgot_state_writes_no_checkpoint_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setitem(STRATEGIES, _Counting.name, _Counting)
    cfg = make_small_cfg("federation.rounds=1", "federation.num_clients=2", strategy={"name": "test-counting"})
    out = tmp_path / "run"
    run_experiment(cfg, out=out, progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert "strategy 'test-counting' cannot be checkpointed" in summary["checkpoint"]
    assert not (out / CHECKPOINT).exists()
