"""Test machinery: the single-process reference runner and fault injection. Nothing here
is reachable from a user's configuration."""
