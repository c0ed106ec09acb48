"""Memory policy on unified memory: the KV budget, activation profiling, wired weights."""
