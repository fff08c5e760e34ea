"""FedKL, the key-lock defense of seed 003 (Ren, PhD thesis, ch. 5), in one package.

* :mod:`clients.fedkl.defense` - the defense ``[[defenses]] name = "fedkl"``: each client merges its
  private key and lock into the received model, trains it and keeps both (:class:`FedKL`);
* :mod:`clients.fedkl.evaluation` - its server-side companion, the observer ``fedkl-random-key`` that the
  defense asks for (``Defense.server_observers``): the global model with a random key, the clients'
  own-key accuracies before and after local training, the thesis's Table 5.1/5.3 numbers, and the
  config check that the model has the blocks to lock.

Importing this package (the composition root does, through ``clients``) registers both.

Two parts live elsewhere because the layers require it (docs/architecture.md, "Where each seed's idea
lives"): the key-lock module itself (:mod:`fedsim.models.keylock`: the lock layers, the key and initial
lock as pure functions of the seed, the names of the key-lock entries and of the lock-leak reply
arrays) is the vocabulary this package *and* the attacker-side ablation build on - the curious server
rebuilds the locked architecture to attack it - and attacks may not import clients, so it is core; the
ablation itself (``[[attack.knowledge]] name = "fedkl"``, :mod:`attacks.fedkl`) is an attacker knowledge,
whose base class lives in ``attacks/``.
"""
from clients.fedkl.defense import FedKL
from clients.fedkl.evaluation import RandomKeyEvaluation

__all__ = ["FedKL", "RandomKeyEvaluation"]
