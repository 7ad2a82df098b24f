"""Old import path of the deterministic reducer: ``from elastic.deterministic import ShardGradReducer`` keeps
working. The code lives in ``elastic.worker.deterministic``."""

from elastic.worker.deterministic import Node as Node
from elastic.worker.deterministic import ShardGradReducer as ShardGradReducer
from elastic.worker.deterministic import dyadic_blocks as dyadic_blocks
from elastic.worker.deterministic import tree_sum as tree_sum
