"""The analytical model checked against the DES on given programs (:mod:`.des`)."""
