"""Offloaded tables: a store on disk under a device cache of hot rows (docs/offload.md).

`store` (the rows on disk), `cache` (which row each cache row holds), `tiered` (`Tiers`: the host side of a
plan's offloaded tables), `serving` (lookups from a store through a RAM cache); the device side is
`core.row_swap`.
"""
