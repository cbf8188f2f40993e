from models.decoder import Decoder

__all__ = ["Decoder"]
