"""What crosses the wire (no Lightning): codecs, the messages' headers and fragments, and the transports that carry
them (point-to-point over process groups; a slow link as a wrapper)."""
