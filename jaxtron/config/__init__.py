"""The config tree (`schema`), how it is loaded from YAML and overrides (`loading`), the checks
across fields and layouts (`checks`), and the platforms a step is built for (`platforms`)."""
