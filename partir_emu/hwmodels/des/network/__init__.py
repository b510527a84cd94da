"""The DES's network: flows at max-min fair rates (:mod:`.flows`), the rate arithmetic they share with
lock-step spans (:mod:`.rates`), and routes over healthy, degraded and failed links (:mod:`.routing`)."""
