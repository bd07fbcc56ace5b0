"""Multi-turn rollouts over a fleet: trajectories."""
