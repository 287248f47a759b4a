"""The entry points and what they share. Importing any of them registers the configs' resolvers once
(runners/resolvers.py)."""

from runners import resolvers as _resolvers  # noqa: F401  (registers every ${flowlm.*} resolver)
