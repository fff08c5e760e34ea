"""Local training on a client, by concern.

* :mod:`fedsim.training.recipe` - the recipe the server configures (:class:`~fedsim.training.recipe.Recipe`);
* :mod:`fedsim.training.schedule` - the round's learning rate (``train.lr_schedule``);
* :mod:`fedsim.training.batches` - the deterministic batch order, a pure function of (seed, round, client);
* :mod:`fedsim.training.loss` - the training loss (``train.loss``);
* :mod:`fedsim.training.local` - :func:`~fedsim.training.local.local_train`, local SGD with the defense
  pipeline;
* :mod:`fedsim.training.evaluation` - a model's loss and accuracy on a split.

The batch schedule is a pure function of (seed, round, client): the client uses it to order its local
mini-batches, and the curious server's *scorer* (never the attack) re-creates it to know which samples a
victim trained on. Nothing travels from client to attacker but the update itself.
"""
