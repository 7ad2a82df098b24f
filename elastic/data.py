"""Old import path of the elastic data cursor: ``from elastic.data import ElasticBatches`` keeps working. The
code lives in ``elastic.worker.data``."""

from elastic.worker.data import BatchConfig as BatchConfig
from elastic.worker.data import DataCursor as DataCursor
from elastic.worker.data import ElasticBatches as ElasticBatches
from elastic.worker.data import ElasticBatchSampler as ElasticBatchSampler
from elastic.worker.data import ElasticDataError as ElasticDataError
from elastic.worker.data import StepPlan as StepPlan
from elastic.worker.data import accumulation_steps as accumulation_steps
from elastic.worker.data import epoch_permutation as epoch_permutation
from elastic.worker.data import global_batch_indices as global_batch_indices
from elastic.worker.data import loss_scale as loss_scale
from elastic.worker.data import micro_batch_sizes as micro_batch_sizes
from elastic.worker.data import plan_step as plan_step
from elastic.worker.data import rank_bounds as rank_bounds
from elastic.worker.data import rank_shares as rank_shares
