"""Speech: Whisper speech-to-text and Silero VAD in MLX, streaming dictation, microphone.

- ``engine.speech.transcribe.transcribe(load_whisper(), audio)``: batch transcription.
- ``engine.speech.stream.DictationSession``: one push-to-talk take (feed chunks, finish).
- ``engine.speech.capture.MicrophoneCapture``: sounddevice input feeding a session.
- ``engine.speech.audio.load_audio``: WAV/FLAC to 16 kHz mono float32.

See docs/speech.md.
"""
