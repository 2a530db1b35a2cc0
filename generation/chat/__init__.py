"""The interactive chat shell (``./bloom.py --chat``): the conversation and its turn format
(``turns``), the hyperparameters a user may show and set (``settings``), where typed lines come
from under tensor parallelism (``lines``), and the terminal loop itself (``shell``)."""
