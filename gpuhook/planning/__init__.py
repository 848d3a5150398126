"""Planning: request + inventory → Plan. Pure: no I/O, no privileges, no logging."""
