"""Graph -> Graph passes and the schedule they share: effects, dead code, liveness, recomputation
(the remat pass and the random-state prims it inserts), BatchNorm written as batch sums; and the commit plan
(which writes of the caller's state a program must copy first to undo a failed step)."""
