"""The three checks of predictions: analytical vs DES on given programs (:mod:`.cases`), predictions
vs published measurements (:mod:`.fidelity`, data in :mod:`.fidelity_data`), and the calibration of
efficiency constants on those measurements (:mod:`.calibrate`)."""
