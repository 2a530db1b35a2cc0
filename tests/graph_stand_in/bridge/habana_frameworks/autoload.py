"""What torch's device-backend autoload calls (a ``torch.backends`` entry point) during ``import torch``."""


def load():
    import habana_frameworks.torch  # noqa: F401  (the bridge reads its environment now)
