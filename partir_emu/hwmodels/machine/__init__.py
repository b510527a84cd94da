"""The machine a program runs on: hardware specs from data files (:mod:`.specs`), topologies
(:mod:`.topology`), links and routes (:mod:`.links`), the placement of a mesh on chips
(:mod:`.placement`) and the search for a better one (:mod:`.search`)."""
