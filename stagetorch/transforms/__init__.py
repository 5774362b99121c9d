"""Graph -> Graph passes and the schedule they share: effects, dead code, liveness, recomputation
(the remat pass and the random-state prims it inserts), BatchNorm written as batch sums."""
