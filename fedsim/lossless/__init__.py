"""Seed 002's accuracy-lossless model perturbation (Yang et al., WWW 2022) for fully connected ReLU nets.

The honest server hides the global model from honest-but-curious clients with one-time secret noise,
the clients train on the perturbed model and send back their perturbed gradient plus a few noise terms,
and the server removes the noise from the *aggregate* with its secrets, obtaining exactly the true
aggregated gradient (Theorems 1-3). Nothing here knows about Flower; see ``docs/lossless.md`` for the
reconstructed equations, the protocol messages and the measured results.

Network (eq. 3, with biases): ``L`` layers ``(W^(l), b^(l))``, ``y^(l) = act(W^(l) y^(l-1) + b^(l))``
for ``l < L`` with ``act`` = ReLU (or LeakyReLU: all Theorem 1 needs is ``act(r z) = r act(z)`` for
``r > 0``), ``y^(L) = W^(L) y^(L-1) + b^(L)``. A bias is treated as one more column of ``W`` whose input
is the constant 1 (never scaled).

Server secrets of one round (:func:`draw_secrets`): positive vectors ``r^(l)`` (``l < L``), a partition
``I_1..I_m`` of the ``n_L`` outputs and one ``gamma_s`` per group (``gamma_i = gamma_s`` for ``i in I_s``).
Public: the additive vector ``r^(a)`` (pairwise distinct, non-zero) and the partition.

Perturbation (eq. 7-9), :func:`perturb`::

    W^(1)^ = r^(1)_i W_ij                         b^(1)^ = r^(1)_i b_i
    W^(l)^ = r^(l)_i / r^(l-1)_j W_ij   (1<l<L)    b^(l)^ = r^(l)_i b_i
    W^(L)^ = W_ij / r^(L-1)_j + gamma_i r^(a)_i    b^(L)^ = b_i + gamma_i r^(a)_i

Theorem 1: ``y^(l)^ = r^(l) o y^(l)`` for hidden layers and ``y^(L)^ = y^(L) + alpha r`` with
``r = gamma o r^(a)`` and ``alpha = sum_j y^(L-1)^_j (+1 for the bias column)``, which the client can
compute (``alpha >= 1`` with a ReLU and a last-layer bias).

Theorem 2 (MSE ``L = 1/2 ||y^ - t||^2``), per example and layer, with ``g^ = y^(L)^ - t``::

    dL^/dW^ = (1/R) o dL/dW + sum_i r_i sigma_i - v beta,    v = r.r
    sigma_i = alpha d y^(L)^_i/dW^ + g^_i d alpha/dW^,      beta = alpha d alpha/dW^

Proof: ``g^ = g + alpha r`` and ``dy^/dW^ = dy/dW^ + r dalpha/dW^``, so ``g^.dy^/dW^ = g.dy/dW^ +
alpha r.dy^/dW^ + (g^.r - alpha v) dalpha/dW^``, and ``g.dy/dW^ = (1/R) o dL/dW`` because ``W`` is an
element-wise affine function of ``W^`` with slope ``1/R``. The client sends the batch means of
``dL^/dW^``, of ``sigma~_s = sum_{i in I_s} r^(a)_i sigma_i`` (``s = 1..m``) and of ``beta``
(:func:`client_terms`); each ``sigma~_s`` is the gradient of the scalar
``mean_b[ sg(alpha_b) sum_{i in I_s} r^(a)_i y^_bi + sg(sum_{i in I_s} r^(a)_i g^_bi) alpha_b ]`` and
``beta`` that of ``mean_b alpha_b^2 / 2`` (``sg`` = stop-gradient), so one ordinary backward pass each.

Recovery (eq. 14-15, Theorem 3), :func:`recover`, for the example-weighted means over clients::

    grad W = R o ( grad^ - sum_s gamma_s sigma~_s + v beta )

which is exact because every term is linear in the per-client means and the secrets are shared by all
clients of the round.

Softmax cross-entropy. With ``L^ = CE(y^, t)`` the client's logit gradient is
``softmax(y + alpha r) - t`` instead of ``softmax(y) - t``: a transcendental function of the secret
``r``. For ``r`` not proportional to the all-ones vector the true aggregate cannot be recovered from
batch aggregates of fixed size (see ``docs/lossless.md``: as a function of ``gamma`` the true
last-layer gradient is a sum of per-example logistic functions with distinct poles, so any exact
formula must see per-example data), and :func:`client_terms` refuses that configuration. The one exact
configuration is the uniform shift (``draw_secrets(..., mode="shift")``: ``m = 1``, ``r^(a) = 1``):
softmax is shift invariant and ``(softmax - t).1 = 0``, so ``dL^/dW^ = (1/R) o dL/dW`` with no noise
terms at all - but then the client sees the true predicted probabilities (no prediction privacy; the
weights and hidden activations stay perturbed).

Numerics: the noise terms are large and cancel in :func:`recover`; use float64 end to end (the default
dtype of the secrets; the perturbed weights come out in that dtype). Recovery is exact only for
FedSGD (one gradient per client per round at the broadcast ``W^``; several mini-batches at the same
``W^`` may be averaged): a local SGD step on ``W^`` leaves the perturbed parameterisation.

The package: :mod:`~fedsim.lossless.network` (the supported models, their layers, the forward pass, the
reference gradient), :mod:`~fedsim.lossless.noise` (secrets, public noise, eq. 7-9),
:mod:`~fedsim.lossless.client` (the client's terms), :mod:`~fedsim.lossless.recovery` (aggregation and
recovery). Its API is the names below; the plugins around it are ``strategies/lossless.py`` (the server
transform ``lossless-perturbation`` and the rule) and ``clients/lossless.py`` (the client's defense).
"""
from fedsim.lossless.client import ClientTerms, client_terms
from fedsim.lossless.network import (
    LOSSES,
    FCSpec,
    Layer,
    check_supported,
    fc_spec,
    forward,
    get_layers,
    layer_shapes,
    set_layers,
    sgd_step,
    true_gradients,
)
from fedsim.lossless.noise import (
    MAX_RANGE_RATIO,
    MODES,
    NOISE_RANGE,
    RANGE_BOUNDS,
    PublicNoise,
    Secrets,
    check_range,
    draw_secrets,
    perturb,
)
from fedsim.lossless.recovery import aggregate, recover

__all__ = [
    "ClientTerms", "FCSpec", "LOSSES", "Layer", "MAX_RANGE_RATIO", "MODES", "NOISE_RANGE", "RANGE_BOUNDS", "PublicNoise", "Secrets", "aggregate",
    "check_range", "check_supported", "client_terms", "draw_secrets", "fc_spec", "forward", "get_layers", "layer_shapes",
    "perturb", "recover", "set_layers", "sgd_step", "true_gradients",
]
