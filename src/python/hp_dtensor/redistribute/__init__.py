"""Changing a DTensor's layout: a pure planner picks the cheapest sequence of collectives, and one
walker executes a plan with a framework's primitives (each step with its dual in backward)."""
