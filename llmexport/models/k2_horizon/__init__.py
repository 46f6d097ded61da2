"""K2-Horizon: grouped RMSNorm, Mixture-of-Values attention, a selection-only router bias."""
