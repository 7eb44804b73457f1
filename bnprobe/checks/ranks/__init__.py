"""A sweep's per-rank check of SyncBatchNorm: each rank's statistics and outputs against the concatenated
batch (:mod:`.check`, :mod:`.outputs`)."""
