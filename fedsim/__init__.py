"""fedsim: a federated-learning privacy lab on Flower."""

__version__ = "0.1.0"
