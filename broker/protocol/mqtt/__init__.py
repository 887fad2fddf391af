"""MQTT 3.1.1 and 5.0, sans I/O: the codec, the packets and the session state machine (docs/mqtt.md)."""
