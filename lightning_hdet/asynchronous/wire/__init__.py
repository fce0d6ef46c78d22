"""What crosses the wire (no Lightning): codecs, headers and fragments, and the transports that carry them."""
