"""tokenaug's command-line tools on timm (not algorithms): ``tokenaug-maps`` (:mod:`.maps_cli`),
``tokenaug-occlusion`` (:mod:`.occlusion_cli`) and what they share (:mod:`.common`)."""
