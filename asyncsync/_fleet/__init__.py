"""Many servers: members, fan-out of control calls, the control routes, routing
decisions and the dispatch of generations."""
