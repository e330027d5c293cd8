"""Safety: push screening, recomputation checks, the coordinator's journal, standbys and fault injection."""
