"""Analysis tools: deviceless compiles (aot), HLO cost, the mesh plan, placement, explain and run reports."""
