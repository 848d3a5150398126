"""Who may hold which GPU: the per-GPU policy, the lease ledger and allocation, as pure values.

Nothing here touches the host: the ledger's store (a file under a lock) is ``provision``'s, and
whether a holder still runs is a function passed in, so every decision is testable as a value.
"""
