"""Storage tiers: the contract (base) and its implementations."""
