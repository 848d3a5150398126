"""Host-side effects a start takes and a stop gives back: today the lease ledger's store and leases.

Beside ``apply`` (which changes the container), never importing it: ``service`` orders both.
"""
