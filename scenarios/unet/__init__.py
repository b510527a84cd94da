"""The U-Net diffusion scenario (:mod:`.scenario`) and its model (:mod:`.model`)."""
