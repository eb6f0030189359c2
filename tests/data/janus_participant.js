// A meeting participant in a Janus VideoRoom, written against Janus's REST API alone (no
// janus.js): it publishes the microphone under a display name and watches another
// participant's feed. The tests drive it through window.participant.
window.participant = (() => {
    let base = '';
    let session = null;
    let tx = 0;
    const events = [];
    const state = {watching: null, speaking: null, samples: []};

    async function post(path, body) {
        const response = await fetch(base + path, {
            method: 'POST', body: JSON.stringify({...body, transaction: 'p' + (++tx)})});
        const reply = await response.json();
        if (reply.janus === 'error') throw new Error('Janus: ' + reply.error.reason);
        return reply;
    }

    async function poll() {
        while (session !== null) {
            try {
                const response = await fetch(`${base}/${session}?maxev=10&rid=${Date.now()}`);
                events.push(...[].concat(await response.json()));
            } catch (error) {
                await new Promise((resolve) => setTimeout(resolve, 200));
            }
        }
    }

    async function event(test, ms = 15000) {
        const deadline = Date.now() + ms;
        while (Date.now() < deadline) {
            const i = events.findIndex(test);
            if (i >= 0) return events.splice(i, 1)[0];
            await new Promise((resolve) => setTimeout(resolve, 50));
        }
        throw new Error('no answer from Janus in time');
    }

    async function message(handle, body, jsep) {
        const reply = await post(`/${session}/${handle}`, {janus: 'message', body, jsep});
        const answer = reply.janus === 'success' ? reply :
            await event((e) => e.transaction === reply.transaction && e.janus === 'event');
        const data = answer.plugindata.data;
        if (data.error_code) throw new Error('VideoRoom: ' + data.error);
        return answer;
    }

    async function attach() {
        const reply = await post(`/${session}`,
            {janus: 'attach', plugin: 'janus.plugin.videoroom'});
        return reply.data.id;
    }

    function gathered(pc) {
        return new Promise((resolve) => {
            if (pc.iceGatheringState === 'complete') return resolve();
            pc.onicegatheringstatechange = () => {
                if (pc.iceGatheringState === 'complete') resolve();
            };
            setTimeout(resolve, 3000);
        });
    }

    async function open(url) {
        base = url;
        session = (await post('', {janus: 'create'})).data.id;
        poll();
        setInterval(() => post(`/${session}`, {janus: 'keepalive'}), 20000);
    }

    // Subscribe to the feed of the participant called `display`; its video plays in a
    // <video> element, and `sample(box)` reads how dark the box of each frame is.
    async function watch(room, display) {
        const handle = await attach();
        const list = await message(handle, {request: 'listparticipants', room});
        const feed = list.plugindata.data.participants.find(
            (p) => p.display === display && p.publisher);
        if (!feed) throw new Error(`${display} is not publishing in room ${room}`);
        const offer = await message(handle,
            {request: 'join', ptype: 'subscriber', room, streams: [{feed: feed.id}]});
        const pc = new RTCPeerConnection();
        const stream = new MediaStream();
        pc.ontrack = (e) => stream.addTrack(e.track);
        await pc.setRemoteDescription(offer.jsep);
        await pc.setLocalDescription(await pc.createAnswer());
        await gathered(pc);
        await message(handle, {request: 'start'},
            {type: 'answer', sdp: pc.localDescription.sdp});
        const video = document.createElement('video');
        video.muted = true;
        video.autoplay = true;
        video.srcObject = stream;
        document.body.appendChild(video);
        state.watching = {pc, video};
    }

    // Publish the (fake) microphone as `display`.
    async function speak(room, display) {
        const handle = await attach();
        await message(handle, {request: 'join', ptype: 'publisher', room, display});
        const mic = await navigator.mediaDevices.getUserMedia({audio: true, video: false});
        const pc = new RTCPeerConnection();
        mic.getTracks().forEach((track) => pc.addTrack(track, mic));
        await pc.setLocalDescription(await pc.createOffer());
        await gathered(pc);
        const answer = await message(handle, {request: 'publish'},
            {type: 'offer', sdp: pc.localDescription.sdp});
        await pc.setRemoteDescription(answer.jsep);
        state.speaking = {pc, handle};
    }

    async function framesDecoded() {
        let frames = 0;
        (await state.watching.pc.getStats()).forEach((s) => {
            if (s.type === 'inbound-rtp' && s.kind === 'video') frames = s.framesDecoded;
        });
        return frames;
    }

    // Every 40 ms for `ms`, the share of the box [y0, y1) x [x0, x1) (of the video at
    // its own size) darker than `luminance`: how open the avatar's mouth is.
    async function sample(box, ms, luminance) {
        const {video} = state.watching;
        const canvas = document.createElement('canvas');
        const context = canvas.getContext('2d', {willReadFrequently: true});
        const out = [];
        const luma = (p, i) => 0.299 * p[i] + 0.587 * p[i + 1] + 0.114 * p[i + 2];
        // Until a frame is presented, drawImage paints nothing (a black box).
        await new Promise((resolve) => video.requestVideoFrameCallback(resolve));
        const end = performance.now() + ms;
        while (performance.now() < end) {
            if (video.videoWidth > 0) {
                canvas.width = video.videoWidth;
                canvas.height = video.videoHeight;
                context.drawImage(video, 0, 0);
                // Even after that callback, headless Chromium has once drawn a first frame
                // black all over. The avatar is never black all over, so such a drawing
                // is not a frame the server sent.
                const whole = context.getImageData(0, 0, canvas.width, canvas.height).data;
                let painted = false;
                for (let i = 0; i < whole.length && !painted; i += 4) {
                    painted = luma(whole, i) >= 40;
                }
                if (painted) {
                    const [y0, y1, x0, x1] = box;
                    const pixels = context.getImageData(x0, y0, x1 - x0, y1 - y0).data;
                    let dark = 0;
                    for (let i = 0; i < pixels.length; i += 4) {
                        if (luma(pixels, i) < luminance) dark += 1;
                    }
                    out.push(dark / (pixels.length / 4));
                }
            }
            await new Promise((resolve) => setTimeout(resolve, 40));
        }
        return out;
    }

    async function leave() {
        for (const part of [state.watching, state.speaking]) part && part.pc.close();
        const id = session;
        session = null;
        if (id !== null) await post(`/${id}`, {janus: 'destroy'});
    }

    return {open, watch, speak, framesDecoded, sample, leave};
})();
