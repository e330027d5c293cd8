"""The task pool: micro-batch states, leases and the todo queues, as plain data and decisions with no I/O."""
