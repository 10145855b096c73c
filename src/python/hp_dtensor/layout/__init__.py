"""Pure geometry of a distributed tensor: mesh topology (which ranks form each mesh dim's group),
local shapes and offsets of even and uneven shards, the ``DTensorSpec`` (mesh, placements, global
shape), and the box each rank writes to and reads from a sharded checkpoint."""
