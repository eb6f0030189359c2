# CPU image: serves the shipped sonic-lite model on ONNX Runtime.
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY server ./server
COPY inference ./inference
COPY engines ./engines
COPY configs ./configs
COPY static ./static
RUN pip install --no-cache-dir . \
    && python -c "import librosa; librosa.filters.mel(sr=16000, n_fft=512, n_mels=80)"

EXPOSE 8080/tcp
# WebRTC media uses UDP on ephemeral ports: run with --network host, or pin ICE host addresses.
CMD ["python", "-m", "server", "--host", "0.0.0.0", "--port", "8080"]
