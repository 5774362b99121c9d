"""Planning: how a staged program runs within a budget: the chunk-size search, recomputation (the
search and its simulator), cutting a step where its examples meet, passes over BatchNorm's statistics, and
the Planner that chooses among them."""
