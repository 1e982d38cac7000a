"""The error raised for an inconsistent configuration."""


class ConfigError(ValueError):
    """A configuration rule was broken; the message names the flags, values and rule."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
